"""Run inside vLLM's own virtualenv (``make vllm-peer``), by ``vllm_peer.engine_decode``: decode tokens/s of
``vllm.LLM.generate`` offline on given prompts, greedy, ``ignore_eos``.

Usage: .venv-vllm/bin/python bench/vllm_engine_decode.py SPEC.json   (prints ``RESULT`` and a JSON list of tokens/s)

SPEC: {"model": DIR, "max_model_len": N, "rows": [{"prompts": [[ids...], ...], "steps": S}, ...]}. Decode speed is
``len(prompts) * steps`` over the time of a generate of ``steps + 1`` tokens minus that of a 1-token generate (the
prefill and the first token), best of ``repeats``, so it compares with benches that time decode steps only. A row
with ``"whole": true`` is timed whole instead (prefill included: ``len(prompts) * steps`` over a generate of
``steps`` tokens), to compare with a bench that times whole requests.
"""

import json
import sys
import time
from pathlib import Path


def main() -> None:
    from vllm import LLM, SamplingParams, TokensPrompt

    spec = json.loads(Path(sys.argv[1]).read_text())
    llm = LLM(model=spec["model"], dtype="float32", max_model_len=spec["max_model_len"], seed=0)

    def generate(prompts: list, tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        began = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - began

    results = []
    for row in spec["rows"]:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in row["prompts"]]
        generate(prompts, 2)  # warm-up: graphs, caches
        best = 0.0
        for _ in range(spec.get("repeats", 2)):
            if row.get("whole"):
                took = generate(prompts, row["steps"])
            else:
                took = generate(prompts, row["steps"] + 1) - generate(prompts, 1)
            best = max(best, len(prompts) * row["steps"] / max(took, 1e-9))
        results.append(best)
    print("RESULT " + json.dumps(results))  # vLLM prints to stdout too: the caller looks for this line


if __name__ == "__main__":
    main()
