"""`pie run` as a user runs it (a subprocess with its own embedded Ray), and Pie's argument-folding rules."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from pie_cluster.cli.arguments import fold_arguments
from support.paths import ROOT

FOLDING = [
    ([], {}),
    (["--prompt", "hi there"], {"prompt": "hi there"}),
    (["--max-tokens", "32"], {"max_tokens": 32}),
    (["--temperature", "0.7"], {"temperature": 0.7}),
    (["--stream", "true", "--echo", "false"], {"stream": True, "echo": False}),
    (["--verbose"], {"verbose": True}),
    (["--verbose", "--n", "3"], {"verbose": True, "n": 3}),
    (["--temp", "-1"], {"temp": True}),  # Pie's rule: a value starting with '-' makes the option a flag
    (["-k", "5"], {"k": 5}),
    (["--x", "1", "-k"], {"x": 1}),  # a lone trailing short option is dropped
    (["a.txt", "--n", "2", "7"], {"n": 2, "_positional": ["a.txt", 7]}),
    (["--name", "True"], {"name": "True"}),  # only lowercase true/false are booleans
    (["--big", "1e3"], {"big": 1000.0}),
]


@pytest.mark.parametrize(("args", "expected"), FOLDING)
def test_argument_folding_follows_pie(args, expected):
    assert fold_arguments(args) == expected


def pie(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": ""}
    return subprocess.run(
        [sys.executable, "-m", "pie_cluster.cli.app", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_pie_run_prints_the_return_value_and_fails_clearly(tmp_path):
    ok = pie("run", "examples/text_completion.py", "--pages", "256", "--", "--max-tokens", "5")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip(), "the reply is printed"
    on_vllm = pie(
        "run", "--backend", "vllm", "examples/text_completion.py", "--pages", "256", "--", "--max-tokens", "5"
    )
    assert on_vllm.returncode == 0, on_vllm.stderr
    assert on_vllm.stdout == ok.stdout  # greedy: vLLM's kernels give the same reply
    unknown = pie("run", "--backend", "tensorrt", "examples/text_completion.py")
    assert unknown.returncode == 2 and "unknown backend 'tensorrt'" in unknown.stdout + unknown.stderr

    bad = tmp_path / "bad.py"
    bad.write_text("async def main(input):\n    raise ValueError('the input needs a --question')\n")
    failed = pie("run", str(bad), "--pages", "64")
    assert failed.returncode == 1
    assert "the input needs a --question" in failed.stdout + failed.stderr

    not_inferlet = tmp_path / "plain.py"
    not_inferlet.write_text("def main(input):\n    return 1\n")
    refused = pie("run", str(not_inferlet))
    assert refused.returncode == 2
    assert "async def main" in refused.stdout + refused.stderr


BUS_AND_MARKET = """
import asyncio
from inferlet import Model, messaging, scheduling

async def main(input):
    feed = messaging.subscribe("news")
    messaging.broadcast("news", "hello subscribers")
    messaging.push("jobs", "job-1")
    got = [await messaging.pull("jobs"), await asyncio.wait_for(feed.next(), 30)]
    feed.unsubscribe()
    return {"got": got, "balance": scheduling.balance(Model.load("default"))}
"""


@pytest.mark.slow
def test_pie_run_serves_messaging_and_the_market_like_a_cluster(tmp_path):
    program = tmp_path / "bus.py"
    program.write_text(BUS_AND_MARKET)
    got = pie("run", str(program), "--pages", "64", "--token-budget", "160")
    assert got.returncode == 0, got.stdout + got.stderr
    result = json.loads(got.stdout)
    assert result["got"] == ["job-1", "hello subscribers"]
    assert result["balance"] == 10.0  # ceil(160 tokens / 16 per page) credits, from the market `pie run` started


def test_pie_model_commands(tmp_path, tiny_llama):
    from pie_cluster.cli.app import app
    from typer.testing import CliRunner

    runner = CliRunner()
    built = runner.invoke(app, ["model", "build-default", "--arch", "qwen3", "--out", str(tmp_path / "q")])
    assert built.exit_code == 0, built.output
    assert (tmp_path / "q" / "model.safetensors").is_file() and str(tmp_path / "q") in built.output
    info = runner.invoke(app, ["model", "info", str(tmp_path / "q")])
    assert info.exit_code == 0 and "Qwen3ForCausalLM" in info.output and "qk_norm" in info.output
    bad = runner.invoke(app, ["model", "build-default", "--arch", "gpt2"])
    assert bad.exit_code != 0 and "gpt2" in bad.output
