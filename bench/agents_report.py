"""The table and plot of bench/agents.py: the median wall time of each (workload, K, system) cell over its rounds,
the ratios between systems computed from those medians, and the cells that failed, with why.

A failed cell shows its reason instead of a time, and every ratio and plotted point that would need it is left out,
so one system's crash at one K does not hide what the others measured.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from report import out_dir, write_markdown
from rich.console import Console
from rich.table import Table
from rich.text import Text

SYSTEMS = ("inferlets", "openai", "responses", "vllm", "vllm-responses")
LABELS = {
    "inferlets": "(a) inferlets",
    "openai": "(b) client over our chat API",
    "responses": "(b') client over our Responses API",
    "vllm": "(c) client over vLLM's chat API",
    "vllm-responses": "(c') client over vLLM's Responses API",
}
RATIOS = (  # (label, numerator system, denominator system): how many times faster the denominator is
    ("inferlets vs our chat", "openai", "inferlets"),
    ("inferlets vs vLLM chat", "vllm", "inferlets"),
    ("our Responses vs vLLM's", "vllm-responses", "responses"),
    ("our Responses / inferlets", "responses", "inferlets"),
)
REASON_CHARS = 60


@dataclass
class Cell:
    """One (workload, K, system): the wall seconds of each round it completed, or why it failed (then no time of it
    is reported: a partial set of rounds would be a biased median)."""

    seconds: list[float] = field(default_factory=list)
    failed: str | None = None

    @property
    def median(self) -> float | None:
        return statistics.median(self.seconds) if self.seconds and not self.failed else None

    @property
    def spread(self) -> float | None:
        """(max - min) / median over the rounds: how far one round may be from the reported median."""
        median = self.median
        return (max(self.seconds) - min(self.seconds)) / median if median else None


Cells = dict[tuple[str, int, str], Cell]  # (workload, K, system) -> Cell


def reason(error: BaseException) -> str:
    """A table-sized why, cut to ~60 characters: the root cause's type (openai's APIConnectionError hides httpx's
    RemoteProtocolError or ReadError) and the first line of the innermost message there is."""
    chain = [error]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    messages = [str(e).strip() for e in reversed(chain) if str(e).strip()]
    text = type(chain[-1]).__name__ + (f": {messages[0].splitlines()[0]}" if messages else "")
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 1] + "…"


def median_of(cells: Cells, key: tuple[str, int, str]) -> float | None:
    cell = cells.get(key)
    return cell.median if cell else None


def cell_text(cells: Cells, key: tuple[str, int, str], turns: int) -> Text | str:
    """Median seconds (turns/s), or the failure as plain Text (a message may hold '[', which rich reads as markup)."""
    cell = cells.get(key)
    if cell is None:
        return "-"
    if cell.failed:
        return Text(f"failed: {cell.failed}")
    return f"{cell.median:.2f} ({turns / cell.median:,.0f})"


def ratio_text(cells: Cells, workload: str, k: int, top: str, bottom: str) -> str:
    numerator, denominator = median_of(cells, (workload, k, top)), median_of(cells, (workload, k, bottom))
    return f"{numerator / denominator:.2f}x" if numerator and denominator else "-"


def table(args, cells: Cells) -> Table:
    systems = [s for s in SYSTEMS if any(key[2] == s for key in cells)]
    ratios = [r for r in RATIOS if r[1] in systems and r[2] in systems]
    title = (
        f"Agents: {args.turns} turns x {args.tokens} tokens, tool delay {args.tool_delay} s, swarm of {args.roles} "
        f"roles; each cell the median wall seconds of {args.rounds} rounds (turns/s); ratios of those medians"
    )
    result = Table(title=title)
    for col in ("workload", "K", *systems, *(label for label, _, _ in ratios)):
        result.add_column(col, justify="right")
    for workload in args.workloads:
        for k in args.ks:
            row = [cell_text(cells, (workload, k, s), k * args.turns) for s in systems]
            row += [ratio_text(cells, workload, k, top, bottom) for _, top, bottom in ratios]
            result.add_row(workload, str(k), *row)
    return result


def spread_note(cells: Cells) -> str | None:
    """The widest round-to-round spread, so a reader can tell a real gap between systems from noise."""
    spreads = [(cell.spread, key) for key, cell in cells.items() if cell.spread is not None]
    if not spreads:
        return None
    worst, (workload, k, system) = max(spreads)
    typical = statistics.median(s for s, _ in spreads)
    return (
        f"round-to-round spread (max - min) / median: typically {typical:.0%}, at most {worst:.0%} "
        f"({system}, {workload} K={k})"
    )


def report(args, cells: Cells, notes: list[str], console: Console) -> None:
    """Print the table and notes, write them to OUT/agents.md and the plot to OUT/agents.png."""
    result = table(args, cells)
    notes = [*notes, *filter(None, [spread_note(cells)])]
    console.print(result)
    for note in notes:
        console.print(Text(note))
    write_markdown(args.out, "agents", [result, *notes])
    plot(args, cells)


def plot(args, cells: Cells) -> None:
    """Median wall time against K per system, bars from the fastest to the slowest round; failed cells left out."""
    directory = out_dir(args.out)
    if directory is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.workloads), figsize=(5 * len(args.workloads), 4), dpi=120, squeeze=False)
    for ax, workload in zip(axes[0], args.workloads, strict=True):
        for system in SYSTEMS:
            done = [(k, cells[workload, k, system]) for k in args.ks if median_of(cells, (workload, k, system))]
            if not done:
                continue
            medians = [cell.median for _, cell in done]
            low = [m - min(cell.seconds) for m, (_, cell) in zip(medians, done, strict=True)]
            high = [max(cell.seconds) - m for m, (_, cell) in zip(medians, done, strict=True)]
            ks = [k for k, _ in done]
            ax.errorbar(ks, medians, yerr=[low, high], marker="o", capsize=3, label=LABELS[system])
        ax.set_xscale("log", base=2)
        ax.set_xticks(args.ks, [str(k) for k in args.ks])
        ax.set_xlabel("agents (ReAct) / pipelines (swarm)")
        ax.set_ylabel(f"wall seconds (median of {args.rounds})")
        ax.set_title(f"{workload}: {args.turns} turns x {args.tokens} tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    directory.mkdir(parents=True, exist_ok=True)
    fig.savefig(directory / "agents.png")
    plt.close(fig)
