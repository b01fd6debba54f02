"""The tables of bench/cluster.py: what (a), (b) and (c) measured, and each against its goal from issue 6.

Goals: launch < 20 ms pooled (median); >= 20k bus messages/s; < 2 MiB per idle pooled inferlet.
"""

from __future__ import annotations

import statistics

from cluster_bus import PULLS_IN_FLIGHT
from rich.table import Table

GOAL_LAUNCH_MS = 20.0
GOAL_BUS_RATE = 20_000
GOAL_IDLE_MIB = 2.0
MIB = 1 << 20


def quantile(values: list[float], q: int) -> float:
    """The q-th percentile (inclusive method), e.g. q=90."""
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def mark(ok: bool) -> str:
    return "[green]yes[/green]" if ok else "[red]no[/red]"


def memory_part(memory: dict) -> tuple[list, tuple]:
    """The (a) table and its clean-up note, and the goal row."""
    table = Table(title=f"(a) memory per idle pooled inferlet ({memory['k']} parked in session.receive(), one host)")
    for col in ("", "RSS", "USS"):
        table.add_column(col, justify="right")
    for label, key in (("host before", "before"), (f"host with {memory['k']} idle", "after")):
        table.add_row(label, f"{memory[key][0] / MIB:,.1f} MiB", f"{memory[key][1] / MIB:,.1f} MiB")
    per = [(memory["after"][i] - memory["before"][i]) / memory["k"] for i in (0, 1)]
    table.add_row("per idle inferlet", f"{per[0] / 1024:,.0f} KiB", f"{per[1] / 1024:,.0f} KiB")
    table.add_row("host after aborting them", *(f"{memory['released'][i] / MIB:,.1f} MiB" for i in (0, 1)))
    ok = memory["ended"] == memory["k"] and memory["running_after"] == memory["running_before"]
    note = (
        f"aborted {memory['aborted']}/{memory['k']}, ended with 'aborted' {memory['ended']}/{memory['k']}; "
        f"launcher's running count {memory['running_before']} before, {memory['running_after']} after "
        f"({'all cleaned up' if ok else '[red]NOT all cleaned up[/red]'})"
    )
    goal = (
        "memory per idle pooled inferlet (RSS)",
        f"{per[0] / MIB:.2f} MiB",
        f"< {GOAL_IDLE_MIB:g} MiB",
        per[0] / MIB < GOAL_IDLE_MIB,
    )
    return [table, note], goal


def latency_part(latency: dict[str, list[float]]) -> tuple[Table, tuple]:
    """The (b) table and the goal row."""
    table = Table(title='(b) launch latency, ms: HTTP launch -> first event of `return "ok"`, sequential launches')
    for col in ("", "launches", "median", "p90", "min", "two requests: median", "launcher actor: median"):
        table.add_column(col, justify="right")
    for name in ("pooled", "isolated"):
        streamed = latency[name]
        table.add_row(
            name,
            str(len(streamed)),
            f"{statistics.median(streamed):,.1f}",
            f"{quantile(streamed, 90):,.1f}",
            f"{min(streamed):,.1f}",
            f"{statistics.median(latency[f'{name}-2req']):,.1f}",
            f"{statistics.median(latency[f'{name}-direct']):,.1f}",
        )
    pooled_median = statistics.median(latency["pooled"])
    goal = (
        "launch latency, pooled, HTTP (one request) median",
        f"{pooled_median:.1f} ms",
        f"< {GOAL_LAUNCH_MS:g} ms",
        pooled_median < GOAL_LAUNCH_MS,
    )
    return table, goal


def bus_part(bus: dict, placement: str, repeats: int) -> tuple[Table, list[tuple]]:
    """The (c) table and a goal row per placement of the pair."""
    table = Table(title=f"(c) message bus between two inferlets, best of {repeats} ({placement})")
    table.add_column("", no_wrap=True)
    for label in bus:
        table.add_column(label, justify="right")
    fmt = "{:,.0f}".format
    table.add_row(f"push -> pull, msgs/s ({PULLS_IN_FLIGHT} pulls in flight)", *(fmt(r["rate"]) for r in bus.values()))
    table.add_row("push -> pull, msgs/s (1 pull in flight)", *(fmt(r["rate_one"]) for r in bus.values()))
    table.add_row("ping-pong round trip, median µs", *(fmt(r["rtt"]) for r in bus.values()))
    table.add_row("ping-pong round trip, p99 µs", *(fmt(r["p99"]) for r in bus.values()))
    goals = [
        (f"bus msgs/s, {label}", fmt(r["rate"]), f">= {GOAL_BUS_RATE:,}", r["rate"] >= GOAL_BUS_RATE)
        for label, r in bus.items()
    ]
    return table, goals


def report(memory: dict, latency: dict[str, list[float]], bus: dict, placement: str, repeats: int) -> list:
    """The tables and notes, in the order they are printed and written to OUT/cluster.md."""
    memory_parts, memory_goal = memory_part(memory)
    latency_table, latency_goal = latency_part(latency)
    bus_table, bus_goals = bus_part(bus, placement, repeats)
    goals = Table(title="goals (issue 6)")
    for col, justify in (("measurement", "left"), ("measured", "right"), ("goal", "right"), ("met", "center")):
        goals.add_column(col, justify=justify)
    for name, value, goal, met in [memory_goal, latency_goal, *bus_goals]:
        goals.add_row(name, value, goal, mark(met))
    return [*memory_parts, latency_table, bus_table, goals]
