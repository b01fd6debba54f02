"""Logit masks as the runner applies them: each distinct mask is checked and expanded to a dense row once.

Constrained decoding sends a handful of distinct masks over and over (a grammar's states recur: every item of a JSON
array, every character of a string), while expanding one takes a dozen numpy calls, tens of microseconds on a
replica whose caches went cold while it waited for the next step. So a mask is expanded once and kept in an LRU per
replica process, keyed by its exact packed bytes (``brle.pack``, how masks arrive on the channel).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pie_workers.wire import brle

CACHE_SIZE = 64  # expanded masks kept per process: a float32 per vocabulary entry each (32 MiB at 128k tokens)


@dataclass(frozen=True)
class ExpandedMask:
    covered: int  # tokens the runs span; a usable mask spans at most the vocabulary
    allows_any: bool  # some token is allowed
    penalty: torch.Tensor | None  # [vocab] float32: 0 where allowed, -inf where not; None if covered > vocab


def expand(mask: bytes | Sequence[int], vocab: int, what: str) -> ExpandedMask:
    """A packed mask, or its runs; raises ``BrleError`` if it is not run lengths or spans more than ``vocab``."""
    packed = mask if isinstance(mask, bytes) else brle.pack(mask, what)
    brle.check_packed(packed, what)  # here, where ``what`` is known: the expansion is cached without it
    expanded = _expand(packed, vocab)
    if expanded.penalty is None:
        raise brle.BrleError(f"malformed {what}: covers {expanded.covered} tokens, vocabulary has {vocab}")
    return expanded


@functools.lru_cache(maxsize=CACHE_SIZE)
def _expand(packed: bytes, vocab: int) -> ExpandedMask:
    runs = brle.unpack(packed)
    covered = int(runs.sum(dtype=np.int64))
    if covered > vocab:
        return ExpandedMask(covered, False, None)
    run_penalty = np.zeros(runs.size, dtype=np.float32)
    run_penalty[::2] = -np.inf
    penalty = np.full(vocab, -np.inf, dtype=np.float32)  # tokens past the runs read as false
    penalty[:covered] = np.repeat(run_penalty, runs)
    return ExpandedMask(covered, bool(runs[1::2].any()), torch.from_numpy(penalty))
