"""From a pass as the SDK asks for it (``wire.messages.PassRequest``) to the runner's ``ForwardRequest``s: what the
pass runs under (``PassBinding``), its rows as one request (``forward_request``), and a single step on one token
(``one_step``), as chained steps and steps run ahead send them.
"""

from __future__ import annotations

from dataclasses import dataclass

from pie_workers.wire.batch import ForwardRequest, Slot
from pie_workers.wire.messages import PassRequest


@dataclass(frozen=True, slots=True)
class PassBinding:
    """What a forward runs under besides its tokens: the salt its KV is hashed with, the adapter and zo seed."""

    salt: bytes = b""
    adapter: int | None = None
    zo_seed: int | None = None


PLAIN_PASS = PassBinding()


def forward_request(
    a: PassRequest, bind: PassBinding, *, tokens, positions, slots, attention_masks, page_ids, kv_len
) -> ForwardRequest:
    """The runner's request for a pass's rows: the given inputs, with the pass's logit mask, drafts and adapter."""
    return ForwardRequest(
        token_ids=tokens,
        positions=positions,
        page_ids=page_ids,
        kv_len=kv_len,
        slots=slots,
        attention_masks=attention_masks,
        logit_mask=a.logit_mask,
        draft_tokens=a.drafts,
        draft_positions=a.draft_positions,
        draft_masks=a.draft_masks,
        adapter=bind.adapter,
        zo_seed=bind.zo_seed,
    )


def one_step(
    token: int, position: int, page_ids: list[int], kv_len: int, slots: list[tuple[int, Slot]], logit_mask, bind
) -> ForwardRequest:
    """A step on one token the replica already knows (the one the step before sampled), over the context's pages:
    a chained pass's next step, or the step run ahead of a plain pass. Positional: keywords cost a tenth of a
    microsecond a step."""
    return ForwardRequest(
        [token], [position], page_ids, kv_len, slots, logit_mask=logit_mask, adapter=bind.adapter, zo_seed=bind.zo_seed
    )
