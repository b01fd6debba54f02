"""A replica smoke run: bring up one (tensor-parallel) replica on Ray and decode a chat reply greedily.

It drives the replica's batch interface directly with one sequence on contiguous pages — the SDK and the replica
engine (contexts, page store, scheduler) are what real inferlets use.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from pie_workers.replica import Replica
from pie_workers.runner import RunnerSettings
from pie_workers.wire.batch import ForwardBatch, ForwardRequest, Slot


@dataclass
class SmokeResult:
    prompt_tokens: int
    tokens: list[int]
    text: str
    seconds: float


def smoke(model_dir: Path, prompt: str, max_tokens: int, tensor_parallel_size: int) -> SmokeResult:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = list(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)["input_ids"])
    settings = RunnerSettings(num_pages=-(-(len(ids) + max_tokens) // 16))
    replica = Replica(model_dir, tensor_parallel_size, settings)
    try:
        pages = list(range(settings.num_pages))
        stop = set(tok.convert_tokens_to_ids([t for t in ("<|im_end|>", "<|endoftext|>") if t in tok.get_vocab()]))
        kv, pending, out = 0, ids, []
        start = time.perf_counter()
        while len(out) < max_tokens:
            req = ForwardRequest(
                pending, list(range(kv, kv + len(pending))), pages, kv, [(len(pending) - 1, Slot.argmax())]
            )
            result = replica.execute(ForwardBatch([req]))[0]
            if result.error:
                raise RuntimeError(result.error)
            kv += len(pending)
            token = result.slots[0].token
            if token in stop:
                break
            out.append(token)
            pending = [token]
        seconds = time.perf_counter() - start
    finally:
        replica.shutdown()
    return SmokeResult(len(ids), out, tok.decode(out), seconds)
