"""Constrained generation and speculation on a Ray replica, one section (and table) each.

Usage: python bench/constrain_spec.py [--items 12] [--repeats 5] [--sections constraints]

constraints: one inferlet decodes greedily in two contexts, alternating step for step: one under a JSON-schema
    constraint (an array of ``--items`` fixed-shape objects, a few hundred tokens), one unconstrained from the same
    prompt. Adjacent steps see the same machine load, so the median of the paired step-time differences is the
    overhead per token (SDK mask work, the mask on the wire, the replica applying it) even on a busy machine. The
    SDK's share is also timed alone by replaying the output through the constraint calls the Generator makes.
    Goal: < 0.1 ms/token.
speculation: greedy decoding of a repetitive prompt without drafts, with the runtime's n-gram drafter
    (``system_speculation``), and with an oracle speculator proposing the true continuation (the ceiling for
    ``--draft`` tokens per pass). Runs alternate by mode; tokens per forward pass and the median time per token.
Sections share one replica.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable

from inferlet import Context, JsonSchema, Model, Sampler
from inferlet.constraints import ConstraintSet
from pie_cluster.hosts.in_process import LocalTrust
from pie_cluster.hosts.run import endpoints_for, run_inferlet
from pie_cluster.ray_session import init_ray
from pie_workers.engine.scheduler import BatchLimits
from pie_workers.replica import Replica
from pie_workers.runner import RunnerSettings
from pie_workers.tiny_model import default_model_path
from rich.console import Console
from rich.table import Table

TRUST = LocalTrust()  # this process is the trusted side: its replica and bus verify what it mints
ITEM = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "name": {"type": "string", "pattern": "^[a-z]{3,10}$"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "name", "tags", "ok"],
}


def records_schema(items: int) -> dict:
    return {"type": "array", "items": ITEM, "minItems": items, "maxItems": items}


async def paired_steps(input: dict) -> dict:
    """Decode greedily in two contexts, step for step: one under the JSON-schema constraint, one free (its stop set
    emptied so it runs as long); returns each step's wall time per side, the document's length in tokens and the
    SDK's seconds per token replaying it."""
    model = Model.load("default")
    with Context(model) as a, Context(model) as b:
        for ctx in (a, b):
            ctx.system("Reply with the records as JSON.").user("List the records.")
            await ctx.flush()
        sides = {
            "constrained": a.generate(Sampler.argmax(), max_tokens=4096, constrain=JsonSchema(input["schema"])),
            "free": b.generate(Sampler.argmax(), max_tokens=4096).stop([]),
        }
        times: dict[str, list[float]] = {name: [] for name in sides}
        tokens: list[int] = []
        while not sides["constrained"].is_done:
            order = list(sides) if len(tokens) % 2 else list(sides)[::-1]  # neither side always goes first
            for name in order:
                start = time.perf_counter()
                out = await (await sides[name].__anext__()).execute()
                times[name].append(time.perf_counter() - start)
                if name == "constrained":
                    tokens += out.tokens
        sdk = replay(model, input["schema"], tokens)
    return {"times": times, "tokens": len(tokens), "sdk": sdk}


def replay(model: Model, schema: dict, tokens: list[int]) -> float:
    """Seconds per token of the Generator's constraint calls alone: mask for the step, admit the sampled token,
    check termination (which steps the grammar)."""
    constraints = ConstraintSet(model)
    constraints.add(JsonSchema(schema))
    start = time.perf_counter()
    for t in tokens:
        constraints.step_mask()
        constraints.admit([t])
        assert not constraints.terminated
    return (time.perf_counter() - start) / len(tokens)


def constraints_section(endpoints, args, console: Console) -> None:
    schema = records_schema(args.items)
    pairs, sdk = [], []
    for _ in range(args.repeats):
        run = asyncio.run(run_inferlet(paired_steps, {"schema": schema}, endpoints, "bench", **TRUST.instance("bench")))
        pairs += zip(run["times"]["constrained"], run["times"]["free"], strict=True)
        sdk.append(run["sdk"])
    constrained, free = (1000 * statistics.median(side) for side in zip(*pairs, strict=True))
    overhead = 1000 * statistics.median(c - f for c, f in pairs)
    table = Table(title=f"JSON-schema constraint vs unconstrained: {len(pairs)} paired greedy steps, tiny Llama")
    for col in ("unconstrained ms/step", "constrained ms/step", "overhead ms/step", "SDK share ms/step"):
        table.add_column(col, justify="right")
    table.add_row(f"{free:.3f}", f"{constrained:.3f}", f"{overhead:+.3f}", f"{1000 * min(sdk):.3f}")
    console.print(table)
    console.print(f"{run['tokens']} tokens per document; medians over steps; overhead: median of paired differences")


REPETITIVE = "Repeat after me: the cat sat on the mat. " * 6


class TrueContinuation:
    """A speculator that knows the answer: the ceiling of what drafting can save."""

    def __init__(self, ctx: Context, truth: list[int], k: int) -> None:
        self.ctx, self.truth, self.k, self.done = ctx, truth, k, 0

    def draft(self) -> tuple[list[int], list[int]]:
        tokens = self.truth[self.done : self.done + self.k]
        first = self.ctx.seq_len + len(self.ctx.buffer())
        return tokens, list(range(first, first + len(tokens)))

    def accept(self, tokens: list[int]) -> None:
        self.done += len(tokens)

    def rollback(self, n: int) -> None:
        pass

    def reset(self) -> None:
        self.done = 0


async def speculative_run(input: dict) -> dict:
    """One greedy generation in the given mode: its tokens, forward passes and seconds after the first step (the
    prefill, the same in every mode)."""
    with Context(Model.load("default")) as ctx:
        ctx.user(REPETITIVE)
        options: dict = {"max_tokens": input["tokens"]}
        if input["mode"] == "system":
            options["system_speculation"] = True
        elif input["mode"] == "oracle":
            options["speculator"] = TrueContinuation(ctx, input["truth"], input["draft"])
        g = ctx.generate(Sampler.argmax(), **options)
        tokens, passes, start = [], 0, 0.0
        async for step in g:
            tokens += (await step.execute()).tokens
            passes += 1
            start = start or time.perf_counter()
        return {"tokens": tokens, "passes": passes, "seconds": time.perf_counter() - start}


def speculation_section(endpoints, args, console: Console) -> None:
    def run(mode: str, truth: list[int] | None = None) -> dict:
        input = {"mode": mode, "tokens": args.spec_tokens, "draft": args.draft, "truth": truth}
        return asyncio.run(run_inferlet(speculative_run, input, endpoints, "bench", **TRUST.instance("bench")))

    truth = run("none")["tokens"]
    runs: dict[str, list[dict]] = {"none": [], "system": [], "oracle": []}
    for _ in range(args.repeats):
        for mode in runs:
            result = run(mode, truth)
            assert result["tokens"] == truth, f"{mode} changed the output"
            runs[mode].append(result)
    assert len(truth) == args.spec_tokens, "the prompt's greedy continuation ended early"
    base = statistics.median(r["seconds"] for r in runs["none"]) / len(truth)
    table = Table(title=f"Speculation: greedy, {len(truth)} tokens of a repetitive prompt, tiny Llama")
    for col in ("drafts", "forward passes", "tokens / pass", "ms / token", "speedup"):
        table.add_column(col, justify="right")
    names = {"none": "none", "system": "system n-gram", "oracle": f"oracle ({args.draft}/pass)"}
    for mode, results in runs.items():
        per_token = statistics.median(r["seconds"] for r in results) / len(truth)
        passes = results[0]["passes"]
        table.add_row(
            names[mode],
            str(passes),
            f"{len(truth) / passes:.2f}",
            f"{1000 * per_token:.2f}",
            f"{base / per_token:.2f}x",
        )
    console.print(table)
    console.print("every mode produced exactly the tokens of the run without drafts; times are medians over runs")


SECTIONS: dict[str, Callable] = {"constraints": constraints_section, "speculation": speculation_section}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=12, help="objects in the generated JSON array")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--spec-tokens", type=int, default=128, help="tokens generated per speculation run")
    ap.add_argument("--draft", type=int, default=4, help="oracle drafts per pass")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from: {', '.join(SECTIONS)}")
    args = ap.parse_args()
    init_ray(num_cpus=4)
    settings = RunnerSettings(num_pages=256)
    replica = Replica(
        default_model_path("llama"), 1, settings, cpus_per_rank=2, engine=BatchLimits(), secret=TRUST.secret
    )
    console = Console()
    try:
        endpoints = endpoints_for("default", replica)
        for name in args.sections.split(","):
            SECTIONS[name](endpoints, args, console)
    finally:
        replica.shutdown()


if __name__ == "__main__":
    main()
