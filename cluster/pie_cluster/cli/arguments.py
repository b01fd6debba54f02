"""Folding trailing command-line arguments into an inferlet's input dict, exactly as Pie's CLIs do.

``--key v`` -> {"key": v} (kebab-case to snake_case); values parse as int, then float, then true/false, else stay
strings; ``--flag`` is true when the next token is missing or starts with ``-`` (so ``--temp -1`` is a flag —
Pie's rule, kept for compatibility); ``-k v`` -> {"k": v} and a lone trailing ``-k`` is dropped; bare words collect
under ``"_positional"``.
"""

from __future__ import annotations

from typing import Any


def parse_value(text: str) -> Any:
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    if text in ("true", "false"):
        return text == "true"
    return text


def fold_arguments(args: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    positional: list[Any] = []
    i = 0
    while i < len(args):
        arg = args[i]
        nxt = args[i + 1] if i + 1 < len(args) else None
        if arg.startswith("--") and len(arg) > 2:
            key = arg[2:].replace("-", "_")
            if nxt is None or nxt.startswith("-"):
                out[key] = True
                i += 1
            else:
                out[key] = parse_value(nxt)
                i += 2
        elif arg.startswith("-") and len(arg) > 1:
            if nxt is not None:
                out[arg[1:].replace("-", "_")] = parse_value(nxt)
            i += 2
        else:
            positional.append(parse_value(arg))
            i += 1
    if positional:
        out["_positional"] = positional
    return out
