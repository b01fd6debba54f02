"""What a bench script leaves under docs/bench: its tables as Markdown (``NAME.md``), for some a plot (``NAME.png``).

Each script adds ``--out`` with :func:`add_out_option` (default: this repository's ``docs/bench``; ``--out ''``
writes nothing), prints its tables as before, and hands the same ``rich`` tables and notes to :func:`write_markdown`.
The Markdown names the command and the machine, so a table is never separated from how it was taken.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from rich.errors import MarkupError
from rich.table import Table
from rich.text import Text

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "bench"


def add_out_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--out",
        default=str(DEFAULT_OUT),
        help="directory for NAME.md (the tables) and NAME.png (the plot); '' writes nothing (default: docs/bench)",
    )


def out_dir(out: str) -> Path | None:
    return Path(out) if out else None


def machine() -> str:
    """One line: cores this process may use, architecture, GPU (when torch is loaded), torch's version and threads."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parts = [f"{cores} CPU cores ({platform.machine()})"]
    torch = sys.modules.get("torch")
    if torch is not None:
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
        parts += [gpu, f"torch {torch.__version__}, {torch.get_num_threads()} threads in the bench's process"]
    return ", ".join(parts)


def _plain(cell) -> str:
    """A cell, title or note as plain text (rich markup such as ``[red]`` dropped), safe inside a table row."""
    try:
        text = cell.plain if isinstance(cell, Text) else Text.from_markup(str(cell)).plain
    except MarkupError:
        text = str(cell)
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(table: Table) -> str:
    """A rich Table as a Markdown table, its title as a bold line above it."""
    columns = table.columns
    align = {"right": "---:", "center": ":---:"}
    lines = []
    if table.title:
        lines += [f"**{_plain(table.title)}**", ""]
    lines.append("| " + " | ".join(_plain(c.header) for c in columns) + " |")
    lines.append("|" + "|".join(align.get(c.justify, "---") for c in columns) + "|")
    for row in zip(*(list(c.cells) for c in columns), strict=True):
        lines.append("| " + " | ".join(_plain(cell) for cell in row) + " |")
    return "\n".join(lines)


def write_markdown(out: str, name: str, parts: Sequence[Table | str]) -> Path | None:
    """Write ``out/name.md``: the command, the machine, then each table (or note, as a paragraph) in order."""
    directory = out_dir(out)
    if directory is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    body = [f"# bench/{name}.py", "", f"Command: `{command}`", "", f"Machine: {machine()}."]
    for part in parts:
        body += ["", markdown_table(part) if isinstance(part, Table) else _plain(part)]
    path = directory / f"{name}.md"
    path.write_text("\n".join(body) + "\n")
    return path


def bar_plot(
    out: str,
    name: str,
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    categories: Sequence[str],
    series: dict[str, Sequence[float]],
    ratios: Sequence[float] | None = None,
    ratio_label: str = "ratio",
    value_format: str = "{x:,.0f}",
) -> Path | None:
    """Grouped bars (one group per category, one bar per series) written to ``out/name.png``; ``ratios``, one per
    category, are printed above each group. The title's lines are wrapped to fit; ``value_format`` labels the y axis
    (e.g. ``"{x:.1f}x"`` for ratios)."""
    directory = out_dir(out)
    if directory is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    width = 0.8 / len(series)
    xs = range(len(categories))
    for k, (label, values) in enumerate(series.items()):
        offset = (k - (len(series) - 1) / 2) * width
        ax.bar([x + offset for x in xs], values, width, label=label)
    if ratios is not None:
        top = max(max(values) for values in series.values())
        for x, ratio in zip(xs, ratios, strict=True):
            peak = max(values[x] for values in series.values())
            ax.annotate(f"{ratio_label} {ratio:.2f}", (x, peak + 0.02 * top), ha="center", va="bottom", fontsize=9)
        ax.set_ylim(0, top * 1.15)
    ax.set_xticks(list(xs), list(categories), fontsize=8 if len(categories) > 6 else None)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title("\n".join(textwrap.fill(line, 90) for line in title.splitlines()), fontsize=10)
    ax.yaxis.set_major_formatter(matplotlib.ticker.StrMethodFormatter(value_format))
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    path = directory / f"{name}.png"
    fig.savefig(path)
    plt.close(fig)
    return path
