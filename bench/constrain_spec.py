"""Constrained generation and speculation on a Ray replica, one section (and table) each.

Usage: python bench/constrain_spec.py [--items 12] [--repeats 5] [--sections constraints]

constraints: one inferlet decodes greedily under a JSON-schema constraint (an array of ``--items`` fixed-shape
    objects, a few hundred tokens) and, interleaved, the same number of tokens unconstrained from the same prompt;
    best of ``--repeats`` each. The end-to-end difference is the overhead per token (SDK mask work, the mask on the
    wire, the replica applying it); it is within this machine's noise, so the SDK's share is also timed exactly by
    replaying the generated tokens through the same constraint calls the Generator makes. Goal: < 0.1 ms/token.
Sections share one replica.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable

from inferlet import Context, JsonSchema, Model, Sampler
from inferlet.constraints import ConstraintSet
from pie_cluster.host import endpoints_for, run_inferlet
from pie_cluster.local_ray import init_ray
from pie_workers.engine.scheduler import BatchLimits
from pie_workers.replica import Replica
from pie_workers.runner import RunnerSettings
from pie_workers.tiny_model import default_model_path
from rich.console import Console
from rich.table import Table

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


async def timed_decode(input: dict) -> dict:
    """Prefill the prompt, then time a greedy generation (constrained by ``schema`` if given, else ``tokens``
    long); with a schema, also replay the output through a fresh ConstraintSet to time the SDK's share alone."""
    model = Model.load("default")
    with Context(model) as ctx:
        ctx.system("Reply with the records as JSON.").user("List the records.")
        await ctx.flush()
        schema = input.get("schema")
        if schema is None:
            g = ctx.generate(Sampler.argmax(), max_tokens=input["tokens"]).stop([])  # exactly that many tokens
        else:
            g = ctx.generate(Sampler.argmax(), max_tokens=4096, constrain=JsonSchema(schema))
        start = time.perf_counter()
        tokens = await g.collect_tokens()
        elapsed = time.perf_counter() - start
    result = {"tokens": tokens, "ms_per_token": 1000 * elapsed / len(tokens)}
    if schema is not None:
        result |= replay(ConstraintSet(model), JsonSchema(schema), tokens)
    return result


def replay(constraints: ConstraintSet, schema: JsonSchema, tokens: list[int]) -> dict:
    """The Generator's constraint calls per token (mask for the step, admit the sampled token, check termination)."""
    constraints.add(schema)
    runs = 0
    start = time.perf_counter()
    for t in tokens:
        runs += len(constraints.step_mask())
        constraints.admit([t])
        assert not constraints.terminated
    elapsed = time.perf_counter() - start
    return {"sdk_ms_per_token": 1000 * elapsed / len(tokens), "mask_ints": runs / len(tokens)}


def run(endpoints, input: dict) -> dict:
    return asyncio.run(run_inferlet(timed_decode, input, endpoints, "bench"))


def constraints_section(endpoints, args, console: Console) -> None:
    schema = records_schema(args.items)
    constrained, free = [], []
    for _ in range(args.repeats):  # interleaved, so load changes hit both sides alike
        constrained.append(run(endpoints, {"schema": schema}))
        free.append(run(endpoints, {"tokens": len(constrained[-1]["tokens"])}))
        assert len(free[-1]["tokens"]) == len(constrained[-1]["tokens"])
    best = min(constrained, key=lambda r: r["ms_per_token"])
    base = min(r["ms_per_token"] for r in free)
    sdk = min(r["sdk_ms_per_token"] for r in constrained)
    table = Table(title=f"JSON-schema constraint vs unconstrained, greedy, {len(best['tokens'])} tokens, tiny Llama")
    for col in ("unconstrained ms/token", "constrained ms/token", "overhead ms/token", "SDK share ms/token"):
        table.add_column(col, justify="right")
    table.add_row(f"{base:.3f}", f"{best['ms_per_token']:.3f}", f"{best['ms_per_token'] - base:+.3f}", f"{sdk:.3f}")
    console.print(table)
    console.print(f"mask on the wire: {best['mask_ints']:.0f} ints per step on average (BRLE over 4,096 ids)")


SECTIONS: dict[str, Callable] = {"constraints": constraints_section}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=12, help="objects in the generated JSON array")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from: {', '.join(SECTIONS)}")
    args = ap.parse_args()
    init_ray(num_cpus=4)
    settings = RunnerSettings(num_pages=256)
    replica = Replica(default_model_path("llama"), 1, settings, cpus_per_rank=2, engine=BatchLimits())
    console = Console()
    try:
        endpoints = endpoints_for("default", replica)
        for name in args.sections.split(","):
            SECTIONS[name](endpoints, args, console)
    finally:
        replica.shutdown()


if __name__ == "__main__":
    main()
