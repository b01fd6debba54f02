"""The examples gallery end to end, on the served tiny model: each example as `pie run` runs it.

The tiny model's text is gibberish, so the tests check what each technique guarantees: a ReAct agent's tool calls
parse and its observations are right, with the KV cache kept across turns; tree-of-thought keeps the branch its
judge scores best and releases the rest; extracted JSON validates; speculative decoding gives greedy decoding's
tokens in fewer passes; a swarm moves every item through every stage once, in order; beam search's scores are
transformers' log-probabilities, and width 1 is greedy decoding."""

from __future__ import annotations

import asyncio
import importlib.util
import re

import jsonschema
import pytest
import torch
from pie_cluster.bus import start_bus
from pie_cluster.hosts.run import run_inferlet
from support.sdk_host import TRUST, each_backend
from test_examples import EXAMPLES, example, hf_greedy_ids, record_forwarded_tokens

served = each_backend()  # every test here runs on the torch and the vllm backend


def module_of(name: str):
    """The example's module itself, for the constants it defines (its regex, its tool)."""
    spec = importlib.util.spec_from_file_location(f"gallery_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_react_agent_calls_its_tool_with_parsed_arguments_and_keeps_its_cache(served, monkeypatch):
    react = module_of("react_agent")
    sent = record_forwarded_tokens(monkeypatch)
    got = served.run(example("react_agent"), {"question": "What is 12 * 7 + 5?", "turns": 3, "seed": 3})
    assert len(got["steps"]) == 3
    for step in got["steps"]:
        a, op, b = re.fullmatch(react.ACTION, step["action"]).groups()
        assert step["args"] == [int(a), op, int(b)]
        assert step["observation"] == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    assert sum(sent) == got["seq_len"], "every token went through the model once: no turn re-sent the conversation"
    assert got["pending"] > 0, "the last observation waits in the buffer for the next turn"
    assert served.stats().contexts == 0


def test_tree_of_thought_keeps_the_best_judged_branch_and_releases_the_rest(served):
    got = served.run(example("tree_of_thought"), {"branches": 3, "levels": 2, "max_tokens": 4})
    assert len(got["tree"]) == 2
    for level in got["tree"]:
        scores = [b["score"] for b in level["branches"]]
        assert len(scores) == 3 and scores[level["chosen"]] == max(scores)
        assert len({tuple(b["tokens"]) for b in level["branches"]}) > 1, "seeded branches differ"
    after = served.stats()
    assert after.contexts == 0 and after.working == 0


def test_json_extraction_always_validates_against_its_schema(served):
    schema = module_of("json_extraction").PERSON
    for seed in range(3):
        got = served.run(example("json_extraction"), {"temperature": 1.0, "seed": seed, "max_tokens": 120})
        jsonschema.validate(got, schema)


def test_speculative_decoding_equals_greedy_in_fewer_passes(served, hf):
    tok, model = hf
    text = "the cat sat on the mat and the cat sat on the mat and the cat sat on the"
    got = served.run(example("speculative_decoding"), {"text": text, "max_tokens": 24})
    prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)["input_ids"]
    assert got["tokens"] == hf_greedy_ids(model, prompt, 24)
    assert got["accepted"] > 0 and got["passes"] < len(got["tokens"])


@pytest.fixture(scope="module")
def bus(ray_session):
    bus = start_bus(1, name="gallery-bus", detached=False, secret=TRUST.secret)
    yield bus
    bus.shutdown()


def test_a_swarm_moves_every_item_through_every_stage_once_in_order(served, bus):
    main, stages, items = example("swarm"), 3, 4
    common = {"stages": stages, "items": items, "prefix": "swarm-test", "max_tokens": 3}

    def run(input: dict):
        return run_inferlet(
            main, {**common, **input}, served.endpoints, "ann", **TRUST.instance("ann"), bus=bus.addresses()
        )

    async def everyone():
        runs = [run({"role": "stage", "stage": i}) for i in range(stages)] + [run({"role": "source"})]
        return await asyncio.wait_for(asyncio.gather(*runs), 120)

    *stage_results, source = asyncio.run(everyone())
    assert [r["handled"] for r in stage_results] == [list(range(items))] * stages, "each item once, in order"
    assert [r["id"] for r in source["results"]] == list(range(items))
    for result in source["results"]:
        assert result["trail"] == list(range(stages))
        assert all(f"[agent {i}]" in result["text"] for i in range(stages))


def hf_logprob_sum(model, prompt: list[int], tokens: list[int]) -> float:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
    return logp[torch.arange(len(tokens)), torch.tensor(tokens)].sum().item()


def test_beam_search_scores_are_transformers_logprobs_and_width_one_is_greedy(served, hf):
    _, model = hf
    wide = served.run(example("beam_search"), {"width": 3, "steps": 5})
    scores = [b["score"] for b in wide["beams"]]
    assert len(scores) == 3 and scores == sorted(scores, reverse=True)
    for beam in wide["beams"]:
        assert beam["score"] == pytest.approx(hf_logprob_sum(model, wide["prompt"], beam["tokens"]), abs=1e-3)
    narrow = served.run(example("beam_search"), {"width": 1, "steps": 5})
    assert narrow["best"]["tokens"] == hf_greedy_ids(model, narrow["prompt"], 5, stops=())
    assert served.stats().contexts == 0
