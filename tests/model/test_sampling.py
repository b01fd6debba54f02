"""Samplers and probes of ``pie_workers.sampling`` against independent float64 numpy references.

Allowed sets are computed in float64 with a small tolerance at the boundary, since the sampler works in
float32 and a token sitting exactly on a top-p / min-p edge (or tied with one) may legitimately go either way.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pie_workers.sampling import run_slots
from pie_workers.wire.batch import GREEDY_TEMPERATURE, Slot, SlotKind

TOL = 1e-5
NEG_INF = float("-inf")
TOKEN_KINDS = [SlotKind.MULTINOMIAL, SlotKind.TOP_K, SlotKind.TOP_P, SlotKind.MIN_P, SlotKind.TOP_K_TOP_P]


def ref_probs(row: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    x = row.astype(np.float64) / temperature
    finite = np.isfinite(x)
    e = np.where(finite, np.exp(x - x[finite].max()), 0.0)
    return e / e.sum()


def ref_allowed(row: np.ndarray, slot: Slot) -> set[int]:
    """Tokens the slot may return under the Pie semantics, with float32-sized slack at boundaries and ties."""
    if slot.is_greedy:
        return {int(np.argmax(row))}
    p = ref_probs(row, slot.temperature)
    keep = p > 0
    if slot.kind in (SlotKind.TOP_K, SlotKind.TOP_K_TOP_P) and slot.top_k > 0:
        kth = np.sort(p)[::-1][min(slot.top_k, len(p)) - 1]
        keep &= p >= kth * (1 - TOL)
    if slot.kind in (SlotKind.TOP_P, SlotKind.TOP_K_TOP_P) and slot.top_p < 1:
        # A token is reachable if the mass ranked clearly above it (ties may sort it first) is below p.
        q = np.where(keep, p, 0.0)
        above = np.array([q[q > qt * (1 + TOL)].sum() for qt in q])
        keep &= above < (slot.top_p + TOL) * q.sum()
    if slot.kind is SlotKind.MIN_P:
        keep &= p >= slot.min_p * p.max() * (1 - TOL)
    return set(np.flatnonzero(keep).tolist())


def tokens(logits: torch.Tensor, slots: list[Slot]) -> list[int]:
    return [o.token for o in run_slots(logits, slots)]


def test_seeded_draw_is_reproducible_and_seeds_differ():
    """Same seed and logits give the same token whatever the batch around it; distinct seeds explore."""
    flat = torch.zeros(1, 64)
    slot = Slot(SlotKind.MULTINOMIAL, seed=1234)
    first = tokens(flat, [slot])[0]
    assert all(tokens(flat, [slot])[0] == first for _ in range(20))
    mixed = torch.cat([torch.randn(3, 64), flat])
    assert tokens(mixed, [Slot(SlotKind.MULTINOMIAL)] * 3 + [slot])[3] == first
    assert len({tokens(flat, [Slot(SlotKind.MULTINOMIAL, seed=s)])[0] for s in range(1, 101)}) > 1
    big_seed = Slot(SlotKind.TOP_P, top_p=0.9, seed=2**64 - 1)
    assert tokens(flat, [big_seed]) == tokens(flat, [big_seed])


@pytest.mark.parametrize(
    "slot",
    [
        Slot(SlotKind.TOP_K, top_k=5),
        Slot(SlotKind.TOP_P, top_p=0.6),
        Slot(SlotKind.MIN_P, min_p=0.2),
        Slot(SlotKind.TOP_K_TOP_P, top_k=8, top_p=0.7),
        Slot(SlotKind.TOP_K_TOP_P, top_k=3, top_p=1.0, temperature=2.0),
        Slot(SlotKind.TOP_P, top_p=0.9, temperature=0.7),
    ],
    ids=lambda s: f"{s.kind}-k{s.top_k}-p{s.top_p}-m{s.min_p}-t{s.temperature}",
)
def test_filters_stay_in_allowed_set(slot):
    """2000 rows in one batched call: every draw is allowed, and draws are not all the same token."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(2000, 32, generator=gen) * 1.5
    logits[:1000] = logits[0]  # half the rows share one distribution, so its allowed set gets sampled richly
    got = tokens(logits, [slot] * 2000)
    rows = logits.numpy()
    shared_allowed = ref_allowed(rows[0], slot)
    assert len(shared_allowed) > 1 and len(set(got[:1000])) > 1 and set(got[:1000]) <= shared_allowed
    for i in range(1000, 2000):
        assert got[i] in ref_allowed(rows[i], slot), (i, got[i])


@pytest.mark.parametrize(
    ("slot", "expected"),
    [
        (Slot(SlotKind.MULTINOMIAL, top_k=1, top_p=0.1, min_p=0.9), {0, 1, 2, 3}),
        (Slot(SlotKind.TOP_K, top_k=2, top_p=0.1, min_p=0.9), {0, 1}),
        (Slot(SlotKind.TOP_P, top_p=0.3), {0}),
        (Slot(SlotKind.TOP_P, top_p=0.6, top_k=1, min_p=0.9), {0, 1}),
        (Slot(SlotKind.TOP_P, top_p=0.75), {0, 1, 2}),
        (Slot(SlotKind.MIN_P, min_p=0.6, top_k=1, top_p=0.1), {0, 1}),
        (Slot(SlotKind.MIN_P, min_p=0.2), {0, 1, 2, 3}),
        (Slot(SlotKind.TOP_K_TOP_P, top_k=3, top_p=0.75), {0, 1}),  # renormalised after top-k: 0.7 -> 0.78
        (Slot(SlotKind.TOP_K_TOP_P, top_k=0, top_p=0.75), {0, 1, 2}),
    ],
)
def test_filters_reach_exactly_the_allowed_set(slot, expected):
    """On probs [.4, .3, .2, .1] each filter yields exactly its set: no token outside it, every token in it,
    and parameters belonging to other kinds are ignored."""
    torch.manual_seed(0)
    row = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    assert set(tokens(row.expand(2000, 4), [slot] * 2000)) == expected


def test_mixed_kinds_in_one_batch_use_their_own_filters():
    """Each row is filtered by its own slot even when the batch needs a sort for some rows only."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(400, 50, generator=gen)
    kinds = [
        Slot(SlotKind.TOP_K, top_k=2),
        Slot(SlotKind.MULTINOMIAL),
        Slot(SlotKind.MIN_P, min_p=0.5),
        Slot(SlotKind.TOP_P, top_p=0.3, seed=9),
        Slot(SlotKind.TOP_K, top_k=1, temperature=0.0),
    ]
    slots = [kinds[i % len(kinds)] for i in range(400)]
    for i, tok in enumerate(tokens(logits, slots)):
        assert tok in ref_allowed(logits[i].numpy(), slots[i])


def test_greedy_and_tiny_temperature_are_argmax():
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(1))
    want = logits.argmax(dim=-1).tolist()
    for kind in TOKEN_KINDS:
        for t in (0.0, GREEDY_TEMPERATURE, GREEDY_TEMPERATURE / 10, -1.0):
            assert tokens(logits, [Slot(kind, temperature=t, seed=5)] * 64) == want
    assert tokens(logits, [Slot.argmax()] * 64) == want
    # Just above the greedy cutoff the softmax is so peaked that a sampled draw is still the argmax.
    assert tokens(logits, [Slot(SlotKind.MULTINOMIAL, temperature=1e-4)] * 64) == want


def test_masked_token_never_returned():
    """Any sampler, any temperature: a -inf logit has probability exactly 0 (greedy ignores it too)."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(3000, 16, generator=gen)
    logits[:, ::2] = NEG_INF
    logits[:, 1] = 50.0  # would win everything if the mask leaked into the ranking of its neighbour
    logits[:, 0] = NEG_INF
    slots = [
        Slot(kind, temperature=t, top_k=4, top_p=0.99, min_p=0.01) for kind in TOKEN_KINDS for t in (0.0, 1.0, 100.0)
    ]
    batch = [slots[i % len(slots)] for i in range(3000)]
    got = tokens(logits, batch)
    assert all(tok % 2 == 1 for tok in got)
    assert len(set(got)) > 1


def test_unsamplable_rows_are_reported_and_rejected():
    logits = torch.randn(4, 8)
    logits[1] = NEG_INF
    logits[3] = NEG_INF
    slots = [Slot(SlotKind.MULTINOMIAL), Slot(SlotKind.TOP_P, temperature=0.0), Slot(SlotKind.MIN_P)]
    slots.append(Slot(SlotKind.LOGITS))
    with pytest.raises(ValueError, match=r"rows \[1\] have no finite logit"):
        run_slots(logits, slots)
    logits[2, 0] = float("nan")  # a broken row is unsamplable too, not a silent garbage token
    with pytest.raises(ValueError, match=r"rows \[1, 2\] have no finite logit"):
        run_slots(logits, slots)
    assert run_slots(logits[[0, 3]], [slots[0], slots[3]])[1].logits == logits[3].numpy().tobytes()


def test_logprobs_full_vocab_sums_to_one_in_order():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 100, generator=gen) * 3
    logits[1, 40:60] = NEG_INF
    order = torch.randperm(100, generator=gen).tolist()
    outs = run_slots(logits, [Slot(SlotKind.LOGPROBS, token_ids=tuple(order))] * 3)
    for i, out in enumerate(outs):
        lp = np.array(out.logprobs)
        assert math.isclose(np.exp(lp).sum(), 1.0, abs_tol=1e-5)
        with np.errstate(divide="ignore"):
            ref = np.log(ref_probs(logits[i].numpy()))[order]
        finite = np.isfinite(ref)
        np.testing.assert_array_equal(np.isfinite(lp), finite)
        np.testing.assert_allclose(lp[finite], ref[finite], atol=1e-5, rtol=0)


def test_logprobs_ragged_labels_and_bad_label():
    logits = torch.randn(2, 10)
    outs = run_slots(logits, [Slot(SlotKind.LOGPROBS, token_ids=(3, 3, 0)), Slot(SlotKind.LOGPROBS)])
    assert len(outs[0].logprobs) == 3 and outs[0].logprobs[0] == outs[0].logprobs[1]
    assert outs[1].logprobs == []
    with pytest.raises(ValueError, match="outside the vocab"):
        run_slots(logits[:1], [Slot(SlotKind.LOGPROBS, token_ids=(10,))])
    with pytest.raises(ValueError, match="outside the vocab"):
        run_slots(logits[:1], [Slot(SlotKind.LOGPROBS, token_ids=(-1,))])


def test_entropy_matches_reference_with_masked_entries():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 300, generator=gen) * 2
    logits[1, :150] = NEG_INF
    logits[2, 1:] = NEG_INF  # one token left: entropy exactly 0
    logits[3] = 0.0  # flat: entropy ln V
    outs = run_slots(logits, [Slot(SlotKind.ENTROPY)] * 5)
    for i, out in enumerate(outs):
        p = ref_probs(logits[i].numpy())
        nz = p[p > 0]
        assert math.isclose(out.entropy, float(-(nz * np.log(nz)).sum()), abs_tol=1e-5)
    assert outs[2].entropy == 0.0
    assert math.isclose(outs[3].entropy, math.log(300), abs_tol=1e-5)


@pytest.mark.parametrize("top_k", [0, -1, 1, 7, 64, 1000])
def test_distribution_sorted_sized_and_correct(top_k):
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 64, generator=gen)
    logits[1, :10] = NEG_INF
    slots = [
        Slot(SlotKind.DISTRIBUTION, temperature=0.7, top_k=top_k),
        Slot(SlotKind.DISTRIBUTION, top_k=top_k),
    ]
    for i, out in enumerate(run_slots(logits, slots)):
        ids, probs = out.distribution
        assert len(ids) == len(probs) == (64 if top_k <= 0 else min(top_k, 64))
        assert all(type(t) is int for t in ids) and all(type(p) is float for p in probs)
        assert probs == sorted(probs, reverse=True)
        ref = ref_probs(logits[i].numpy(), slots[i].temperature)
        np.testing.assert_allclose(probs, ref[ids], atol=1e-6, rtol=0)
        np.testing.assert_allclose(probs, np.sort(ref)[::-1][: len(ids)], atol=1e-6, rtol=0)


def test_distribution_at_zero_temperature_is_one_hot():
    """Distribution clamps T to the greedy cutoff rather than dividing by zero."""
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    ids, probs = run_slots(logits, [Slot(SlotKind.DISTRIBUTION, temperature=0.0)])[0].distribution
    assert ids[0] == 1 and probs[0] == 1.0 and sum(probs[1:]) == 0.0


def test_logits_bytes_round_trip_exactly():
    logits = torch.randn(2, 33)
    logits[0, 5] = NEG_INF
    for i, out in enumerate(run_slots(logits, [Slot(SlotKind.LOGITS)] * 2)):
        assert len(out.logits) == 33 * 4
        back = np.frombuffer(out.logits, dtype=np.float32)
        np.testing.assert_array_equal(back, logits[i].numpy())


def test_multinomial_frequencies_match_softmax():
    """Statistical sanity of the exponential-race draw: 20000 draws land within 1.5% of softmax."""
    torch.manual_seed(0)
    row = torch.tensor([1.0, 0.0, -1.0, 0.5])
    got = tokens(row.expand(20000, 4).contiguous(), [Slot(SlotKind.MULTINOMIAL)] * 20000)
    freq = np.bincount(got, minlength=4) / 20000
    np.testing.assert_allclose(freq, ref_probs(row.numpy()), atol=0.015)


def test_mixed_probes_and_tokens_keep_row_order():
    logits = torch.randn(4, 20)
    slots = [Slot(SlotKind.ENTROPY), Slot.argmax(), Slot(SlotKind.LOGITS)]
    slots.append(Slot(SlotKind.DISTRIBUTION, top_k=2))
    outs = run_slots(logits, slots)
    assert outs[0].entropy is not None and outs[0].token is None
    assert outs[1].token == int(logits[1].argmax())
    assert outs[2].logits is not None and outs[3].distribution[0][0] == int(logits[3].argmax())


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    vocab=st.integers(1, 12),
    kind=st.sampled_from(TOKEN_KINDS),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 4.0]),
    top_k=st.integers(-1, 14),
    top_p=st.floats(0.0, 1.0),
    min_p=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32),
)
def test_property_token_always_allowed(data, vocab, kind, temperature, top_k, top_p, min_p, seed):
    """Random rows (some entries masked) and parameters: the draw is always in the reference allowed set."""
    values = st.one_of(st.floats(-8, 8, width=32), st.just(NEG_INF))
    row = data.draw(st.lists(values, min_size=vocab, max_size=vocab).filter(lambda r: max(r) > NEG_INF))
    slot = Slot(kind, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    logits = torch.tensor([row] * 8, dtype=torch.float32)
    assert set(tokens(logits, [slot] * 8)) <= ref_allowed(logits[0].numpy(), slot)


def test_samplers_report_their_token_logprob_and_alternatives_when_asked():
    """``report_logprobs``: the sampled token's log-probability and the top alternatives, of the masked, untempered
    row (float64 numpy reference); rows that did not ask report nothing, and the report survives the wire."""
    from pie_workers.wire.codec import output_from_wire, output_to_wire, slot_from_wire, slot_to_wire

    rng = np.random.default_rng(3)
    logits = torch.tensor(rng.normal(size=(3, 64)), dtype=torch.float32)
    logits[1, :8] = NEG_INF  # a masked row: its masked tokens are never alternatives
    slots = [
        Slot(SlotKind.TOP_P, temperature=0.0, report_logprobs=5),
        Slot(SlotKind.MULTINOMIAL, temperature=0.7, seed=11, report_logprobs=0),
        Slot(SlotKind.TOP_K, temperature=1.0, top_k=4),
    ]
    out = run_slots(logits, [slot_from_wire(slot_to_wire(s)) for s in slots])
    for row, report_top in ((0, 5), (1, 0)):
        x = logits[row].double().numpy()
        finite = np.isfinite(x)
        ref = np.where(finite, x - (np.log(np.exp(x[finite] - x[finite].max()).sum()) + x[finite].max()), -np.inf)
        got = output_from_wire(output_to_wire(out[row])).sampled_logprobs
        assert out[row].token is not None and got.logprob == pytest.approx(ref[out[row].token], abs=TOL)
        assert got.top_ids == list(np.argsort(-ref)[:report_top])
        assert got.top_logprobs == pytest.approx(sorted(ref, reverse=True)[:report_top], abs=TOL)
    assert out[0].token == out[0].sampled_logprobs.top_ids[0]  # greedy: the most likely token
    assert out[2].sampled_logprobs is None and out[2].token is not None
