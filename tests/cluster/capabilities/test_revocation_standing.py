"""What a replica or bus shard keeps of ended instances is bounded by what runs, not by what ever ended, and a
target that (re)starts knowing nothing learns what ended from each minter's next standing.

The minter is the real ``Revoker`` a node host or ingress replica uses, and the target side the real ``Verifier``
both replicas and shards hold; what travels between them is the ``Revocation`` records the revoker makes. The same
path through real actors (a bus shard started after an instance ended) is in ``test_capabilities_revocation.py``.
"""

from __future__ import annotations

import asyncio

import pytest
from pie_cluster.hosts.revocations import Revoker
from pie_workers.wire.admission import Revocation, RevokedError, Verifier
from pie_workers.wire.capability import mint
from support.forgery import SECRET

TTL_S = 3600.0


def minted(revoker: Revoker, count: int, user: str = "alice") -> list[tuple[str, str]]:
    """``count`` instances' (id, capability), minted in order by ``revoker``."""
    out = []
    for n in range(count):
        instance = f"{user}-{n}"
        out.append((instance, mint(SECRET, user, instance, TTL_S, minting=revoker.minted(instance, TTL_S))))
    return out


def endings(revoker: Revoker, instances: list[str]) -> Revocation:
    """The record a revoker sends at the end of the loop turn in which ``instances`` ended."""
    revoker.ended(instances)
    batch, revoker._ended = revoker._ended, {}  # taken here instead of sent at the end of the turn
    return Revocation(revoker.minter, ended=batch)


def refused(verifier: Verifier, token: str) -> bool:
    try:
        verifier.verify(token)
    except RevokedError:
        return True
    return False


def test_a_target_holds_the_live_set_not_an_entry_per_instance_that_ever_ended():
    async def story():
        revoker = Revoker(lambda: ())
        target = Verifier(SECRET)
        tokens = minted(revoker, 10_000)
        ended, running = tokens[:9_990], tokens[9_990:]
        target.revoke(endings(revoker, [instance for instance, _ in ended]))
        assert all(refused(target, token) for _, token in ended[:100])  # at once, before any standing
        target.revoke(revoker.standing())
        assert len(target.revoked) <= len(running) + 1, len(target.revoked)  # its live set, and the minter
        assert all(refused(target, token) for _, token in ended)
        assert not any(refused(target, token) for _, token in running)

        later = minted(revoker, 1, "bob")  # past the standing's floor: served until its ending says otherwise
        assert not refused(target, later[0][1])
        target.revoke(endings(revoker, ["bob-0"]))
        assert refused(target, later[0][1])

    asyncio.run(story())


def test_a_restarted_target_refuses_what_ended_before_it_started_once_the_minters_standing_arrives():
    async def story():
        revoker = Revoker(lambda: ())
        (alice, alices), (_, bobs) = minted(revoker, 1, "alice")[0], minted(revoker, 1, "bob")[0]
        before = Verifier(SECRET)
        before.revoke(endings(revoker, [alice]))
        assert refused(before, alices)

        restarted = Verifier(SECRET)  # knows nothing of alice's ending: it was sent to its previous incarnation
        assert not refused(restarted, alices)  # (the window: until the minter's next standing, STANDING_S at most)
        assert restarted.revoke(revoker.standing()) == {alice}  # her connections here are to be closed
        assert refused(restarted, alices) and not refused(restarted, bobs)

    asyncio.run(story())


def test_standings_of_one_minter_never_refuse_another_minters_capabilities():
    async def story():
        first, second = Revoker(lambda: ()), Revoker(lambda: ())
        (_, mine), (_, theirs) = minted(first, 1)[0], minted(second, 1, "bob")[0]
        target = Verifier(SECRET)
        target.revoke(first.standing())
        target.revoke(second.standing())
        assert not refused(target, mine) and not refused(target, theirs)
        assert first.minter != second.minter

    asyncio.run(story())


@pytest.mark.parametrize("grants", [{"minter": "m"}, {"seq": 3}, {"minter": 7, "seq": 3}, {"minter": "m", "seq": True}])
def test_a_signed_capability_with_half_or_wrongly_typed_minting_claims_is_malformed(grants):
    import json

    from pie_workers.wire.capability import CapabilityError, _encode, _sign, verify

    claims = ["alice", "i", 2e9, {"models": None, "tokens": None} | grants]
    payload = _encode(json.dumps(claims).encode())
    with pytest.raises(CapabilityError, match="malformed capability"):
        verify(SECRET, f"{payload}.{_encode(_sign(SECRET, payload))}")
