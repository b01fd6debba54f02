"""Identity from the trusted side: replicas and bus shards believe only capabilities signed with the cluster's
secret, never a name the client sends.

This file: the token itself, fuzzed (random text, tampered payload fields, flipped signature bits, a wrong secret,
expiry), and no replica or bus shard without a secret. Attackers speaking the wire protocols by hand over real
sockets, claiming to be bob with a forged capability, with alice's genuine one or with bob's expired one:
``test_capabilities_replica.py`` (the replica channel over Unix sockets and TCP, and the market's wallets) and
``test_capabilities_bus.py`` (a bus shard through a raw ZeroMQ DEALER). Each is refused and bob's snapshot and queue
stay his.
"""

from __future__ import annotations

import base64
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pie_cluster.bus.shard import BusShard
from pie_workers.wire.capability import CapabilityError, mint, verify
from support.forgery import SECRET, claims, forged

# -- the token ----------------------------------------------------------------------------------------------------

names = st.text(max_size=40)


@settings(max_examples=300, deadline=None)
@given(user=names, instance=names, ttl=st.floats(1, 1e7))
def test_a_minted_capability_verifies_and_is_printable_without_slashes(user, instance, ttl):
    token = mint(SECRET, user, instance, ttl)
    assert token.isascii() and token.isprintable() and "/" not in token and " " not in token
    got = verify(SECRET, token)
    assert (got.user, got.instance) == (user, instance) and got.expires > time.time()


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")))
def test_random_text_is_never_a_capability(text):
    with pytest.raises(CapabilityError, match="malformed|bad capability signature"):
        verify(SECRET, text)


@settings(max_examples=300, deadline=None)
@given(
    user=names,
    instance=names,
    field=st.sampled_from(["user", "instance", "expires"]),
    other=names | st.floats(allow_nan=False) | st.integers(),
)
def test_a_changed_payload_field_breaks_the_signature(user, instance, field, other):
    token = mint(SECRET, user, instance, 3600)
    tampered = forged(token, **{field: other})
    if tampered != token:
        with pytest.raises(CapabilityError, match="bad capability signature"):
            verify(SECRET, tampered)


@settings(max_examples=300, deadline=None)
@given(user=names, bit=st.integers(0, 255))
def test_a_flipped_signature_bit_is_refused(user, bit):
    payload, signature = mint(SECRET, user, "i", 3600).split(".")
    raw = bytearray(base64.urlsafe_b64decode(signature + "="))
    raw[bit // 8] ^= 1 << (bit % 8)
    flipped = base64.urlsafe_b64encode(bytes(raw)).decode().rstrip("=")
    with pytest.raises(CapabilityError, match="bad capability signature"):
        verify(SECRET, f"{payload}.{flipped}")


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_changed_character_is_refused(data):
    token = mint(SECRET, data.draw(names), data.draw(names), 3600)
    at = data.draw(st.integers(0, 1 << 16)) % len(token)  # the token's length varies with the clock
    char = data.draw(st.characters().filter(lambda c: c != token[at]))
    with pytest.raises(CapabilityError):
        verify(SECRET, token[:at] + char + token[at + 1 :])


@settings(max_examples=200, deadline=None)
@given(secret=st.binary(min_size=1, max_size=64).filter(lambda s: s != SECRET), user=names)
def test_a_capability_minted_with_another_secret_is_refused(secret, user):
    with pytest.raises(CapabilityError, match="bad capability signature"):
        verify(SECRET, mint(secret, user, "i", 3600))


@settings(max_examples=200, deadline=None)
@given(ttl=st.floats(0.001, 1e7), later=st.floats(0, 1e7))
def test_a_capability_past_its_lifetime_is_refused(ttl, later):
    token = mint(SECRET, "alice", "i", ttl)
    with pytest.raises(CapabilityError, match="expired capability"):
        verify(SECRET, token, now=claims(token)[2] + later)


def test_minting_needs_a_secret_and_a_lifetime():
    with pytest.raises(ValueError, match="secret"):
        mint(b"", "alice", "i", 60)
    for ttl in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="lifetime"):
            mint(SECRET, "alice", "i", ttl)


def test_no_replica_or_bus_shard_runs_without_a_secret(ray_session, tiny_llama):
    from pie_workers.engine.scheduler import BatchLimits
    from pie_workers.replica import Replica

    with pytest.raises(ValueError, match="secret"):
        Replica(tiny_llama, 1, engine=BatchLimits())
    with pytest.raises(ValueError, match="secret"):
        BusShard(0, 1, b"")
