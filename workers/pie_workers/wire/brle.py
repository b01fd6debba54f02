"""Binary run-length encoding (BRLE) of boolean masks — one definition shared by the SDK and the replica.

A BRLE is a list of non-negative run lengths that always starts with a *false* run (possibly 0): even indices are
false runs, odd indices true runs. ``[F,F,T,T,T,F] -> [2, 3, 1]``; all-true(n) is ``[0, n]``; all-false(n) is ``[n]``.
Its logical length is the sum of the runs. Bits past the encoded length read as false. For logit masks the empty
list means "no restriction" (see :func:`and_masks`). On the channel a logit mask travels packed (:func:`pack`).
"""

from __future__ import annotations

import array
import sys
from collections.abc import Iterable, Sequence

import numpy as np


class BrleError(ValueError):
    """A BRLE that is not a list of non-negative integer run lengths."""


def validate(runs: Sequence[int], what: str = "BRLE") -> np.ndarray:
    """The runs as an int64 array, checked in one vectorized pass (masks reach thousands of runs per step)."""
    arr = np.asarray(runs)
    if arr.ndim == 1 and (arr.size == 0 or (arr.dtype.kind in "iu" and arr.min() >= 0)):
        return arr.astype(np.int64, copy=False)
    bad = next((r for r in runs if not isinstance(r, (int, np.integer)) or not 0 <= r < 1 << 63), runs)
    raise BrleError(f"malformed {what}: run lengths must be non-negative integers, got {bad!r}")


def length(runs: Sequence[int]) -> int:
    return int(sum(runs))


def encode(bits: Iterable[bool] | np.ndarray) -> list[int]:
    """Encode a boolean sequence; the result starts with a false run."""
    arr = np.asarray(list(bits) if not isinstance(bits, np.ndarray) else bits, dtype=bool)
    if arr.size == 0:
        return []
    change = np.flatnonzero(arr[1:] != arr[:-1]) + 1
    bounds = np.concatenate(([0], change, [arr.size]))
    runs = np.diff(bounds).tolist()
    return [0, *runs] if arr[0] else runs


def decode(runs: Sequence[int], size: int | None = None) -> np.ndarray:
    """Decode to a bool array of ``size`` (default: the logical length); bits past the runs are false."""
    lengths = validate(runs)
    values = np.zeros(len(lengths), dtype=bool)
    values[1::2] = True
    bits = np.repeat(values, lengths)
    if size is None:
        return bits
    out = np.zeros(size, dtype=bool)
    n = min(size, bits.size)
    out[:n] = bits[:n]
    return out


PACKED_RUN_BYTES = 4  # a packed run length is a little-endian uint32


def pack(runs: Sequence[int], what: str = "BRLE") -> bytes:
    """The runs as little-endian uint32s: one buffer the replica reads in place (and can key a cache by), where a
    list would be unpacked into Python ints and converted again. (``array`` of C unsigned ints, 32-bit on every
    platform CPython supports: about half the cost of ``struct.pack`` per step.)"""
    try:
        packed = array.array("I", runs)
    except (TypeError, OverflowError):
        bad = next((r for r in runs if not isinstance(r, (int, np.integer)) or not 0 <= r < 1 << 32), runs)
        raise BrleError(f"malformed {what}: run lengths must be integers in [0, 2**32), got {bad!r}") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def check_packed(packed: bytes, what: str = "BRLE") -> None:
    """Raise ``BrleError`` unless ``packed`` holds whole run lengths."""
    if len(packed) % PACKED_RUN_BYTES:
        raise BrleError(f"malformed {what}: {len(packed)} bytes do not hold whole uint32 run lengths")


def unpack(packed: bytes, what: str = "BRLE") -> np.ndarray:
    """The runs of a :func:`pack` ed mask, read in place (uint32: non-negative by construction)."""
    check_packed(packed, what)
    return np.frombuffer(packed, dtype="<u4")


def decode_rows(rows: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """Decode many BRLE rows into a ``[len(rows), width]`` bool matrix in one vectorized pass.

    Bits past a row's encoded length are false; bits beyond ``width`` raise, since they name slots that don't exist.
    """
    if not rows:
        return np.zeros((0, width), dtype=bool)
    lens = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    flat = np.fromiter((x for r in rows for x in r), dtype=np.int64, count=int(lens.sum()))
    if flat.size and flat.min() < 0:
        raise BrleError("malformed BRLE: negative run length")
    row_of_run = np.repeat(np.arange(len(rows)), lens)
    run_index = np.arange(flat.size) - np.repeat(np.cumsum(lens) - lens, lens)
    totals = np.bincount(row_of_run, weights=flat, minlength=len(rows)).astype(np.int64)
    if totals.size and totals.max() > width:
        bad = int(np.argmax(totals > width))
        raise BrleError(f"malformed BRLE: row {bad} covers {int(totals[bad])} slots but only {width} exist")
    true_runs = (run_index % 2) == 1
    # Expand each true run into its bit coordinates.
    starts = np.cumsum(flat) - flat
    starts -= np.repeat(np.cumsum(totals) - totals, lens)  # start offset within the row
    sel = true_runs & (flat > 0)
    run_rows, run_starts, run_lens = row_of_run[sel], starts[sel], flat[sel]
    out = np.zeros((len(rows), width), dtype=bool)
    if run_lens.size:
        reps = np.repeat(np.arange(run_lens.size), run_lens)
        offsets = np.arange(reps.size) - np.repeat(np.cumsum(run_lens) - run_lens, run_lens)
        out[run_rows[reps], run_starts[reps] + offsets] = True
    return out


def all_true(n: int) -> list[int]:
    return [0, n]


def and_masks(a: Sequence[int], b: Sequence[int]) -> list[int]:
    """AND two masks. An empty operand means "no restriction", so the other is returned unchanged.

    The result is as long as the longer operand (bits past an operand's end are false, so the tail is false).
    """
    if not a:
        return list(b)
    if not b:
        return list(a)
    n = max(length(a), length(b))
    return encode(decode(a, n) & decode(b, n))


def and_many(masks: Iterable[Sequence[int]]) -> list[int]:
    out: list[int] = []
    for m in masks:
        out = and_masks(out, m)
    return out


def from_bitmask(words: np.ndarray, size: int) -> list[int]:
    """Encode the first ``size`` bits of a packed bitmask: bit ``i`` is bit ``i % 32`` of 32-bit word ``i // 32``.

    This is the layout grammar engines (xgrammar) fill per step, so a grammar mask becomes a BRLE in a few
    vectorized passes instead of a Python loop over the vocabulary.
    """
    raw = np.ascontiguousarray(words, dtype="<i4").view(np.uint8)
    return encode(np.unpackbits(raw, count=size, bitorder="little").view(bool))


def allows(runs: Sequence[int], index: int) -> bool:
    """Whether bit ``index`` of the mask is true (bits past the end are false). A walk that stops at the run holding
    the bit: it runs once per sampled token, on masks of a handful of runs at most steps."""
    end = 0
    for run, length in enumerate(runs):
        end += length
        if index < end:
            return run % 2 == 1
    return False
