"""Capabilities: who an inferlet instance is, minted by the trusted side and checked by everything it connects to.

User code runs in sandboxed processes, so nothing it says about itself can be believed. The trusted host that
launches an instance mints a token binding (user, instance, expiry, grants) with the cluster's secret; replicas and
bus shards hold the same secret and take user and instance from a token that verifies, never from a name the client
sends. The grants say what the instance was given, so that what enforces them is the trusted side: the models it may
reach (None: every model of the cluster) and the tokens it may have generated (None: no budget). The token is
printable and has no ``/`` (it travels inside the replica channel's session strings)::

    base64url(json [user, instance, expires, {"models": [...] | null, "tokens": n | null,
                                              "minter": id | null, "seq": n | null}])
        "." base64url(HMAC-SHA256(secret, DOMAIN + payload))

``minter`` and ``seq`` say which trusted process minted it and in what order (``wire/admission.py``: what a replica
or shard keeps of ended instances is each minter's live set, not one entry per instance that ever ended).

Base64 without padding, and only its canonical form is accepted, so one capability has exactly one spelling.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import time
from dataclasses import dataclass

DOMAIN = b"pie-capability-v2."
"""Signed ahead of the payload, so a MAC made with the cluster's secret for any other purpose is never a capability."""
MAX_LENGTH = 4096  # characters: a longer token is refused before any decoding
_SIGNATURE_BYTES = hashlib.sha256().digest_size


class CapabilityError(PermissionError):
    """The capability does not prove who the caller is: malformed, not signed with the cluster's secret, or expired."""


@dataclass(frozen=True)
class Capability:
    user: str
    instance: str
    expires: float  # seconds since the epoch (``time.time()``)
    models: tuple[str, ...] | None = None  # the models it may reach; None: all
    token_budget: int | None = None  # tokens the model may generate for it, counted where its passes run
    minter: str | None = None  # the trusted process that minted it (one per process incarnation); None: unordered
    seq: int | None = None  # its place among that minter's capabilities


@dataclass(frozen=True)
class Minting:
    """Which trusted process mints a capability, and its place in that process's order."""

    minter: str
    seq: int


def mint(
    secret: bytes,
    user: str,
    instance: str,
    ttl_s: float,
    *,
    models: tuple[str, ...] | None = None,
    token_budget: int | None = None,
    minting: Minting | None = None,
) -> str:
    """A token saying that ``instance`` runs as ``user`` for the next ``ttl_s`` seconds, granted ``models`` and
    ``token_budget``; ``minting``: by whom and in what order (``hosts/revocations.py``)."""
    if not secret:
        raise ValueError("a capability needs the cluster's secret; an empty one would prove nothing")
    if not math.isfinite(ttl_s) or ttl_s <= 0:
        raise ValueError(f"a capability's lifetime is a positive number of seconds, not {ttl_s!r}")
    grants = {"models": None if models is None else sorted(models), "tokens": token_budget}
    if minting is not None:
        grants |= {"minter": minting.minter, "seq": minting.seq}
    claims = [user, instance, time.time() + ttl_s, grants]
    payload = _encode(json.dumps(claims, separators=(",", ":")).encode())
    return f"{payload}.{_encode(_sign(secret, payload))}"


def verify(secret: bytes, token: str, now: float | None = None) -> Capability:
    """The identity ``token`` proves at ``now`` (default: the current time); raises ``CapabilityError`` saying what
    is wrong with it."""
    if not isinstance(token, str) or len(token) > MAX_LENGTH or token.count(".") != 1:
        raise CapabilityError("malformed capability: not of the form payload.signature")
    payload, signature = token.split(".")
    claims, mac = _decode(payload), _decode(signature)
    if len(mac) != _SIGNATURE_BYTES:
        raise CapabilityError("malformed capability: its signature has the wrong length")
    if not hmac.compare_digest(mac, _sign(secret, payload)):
        raise CapabilityError("bad capability signature: it was not minted by this cluster, or was altered")
    try:
        user, instance, expires, grants = json.loads(claims)
        models, tokens = grants["models"], grants["tokens"]
        minter, seq = grants.get("minter"), grants.get("seq")
    except (ValueError, TypeError, KeyError, AttributeError):
        raise CapabilityError("malformed capability: its payload is not [user, instance, expiry, grants]") from None
    if not (
        isinstance(user, str)
        and isinstance(instance, str)
        and isinstance(expires, (int, float))
        and (models is None or (isinstance(models, list) and all(isinstance(m, str) for m in models)))
        and (tokens is None or (isinstance(tokens, int) and not isinstance(tokens, bool)))
        and (minter is None) == (seq is None)
        and (minter is None or (isinstance(minter, str) and isinstance(seq, int) and not isinstance(seq, bool)))
    ):
        raise CapabilityError("malformed capability: its payload is not [user, instance, expiry, grants]")
    if (time.time() if now is None else now) >= expires:
        raise CapabilityError(f"expired capability: instance {instance!r} of user {user!r} is past its lifetime")
    models = None if models is None else tuple(models)
    return Capability(user, instance, float(expires), models, tokens, minter, seq)


def _sign(secret: bytes, payload: str) -> bytes:
    return hmac.new(secret, DOMAIN + payload.encode("ascii"), hashlib.sha256).digest()


def _encode(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def _decode(text: str) -> bytes:
    """Strict: only base64url's alphabet, and only the canonical spelling of the bytes."""
    try:
        raw = base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raise CapabilityError("malformed capability: not base64url") from None
    if _encode(raw) != text:
        raise CapabilityError("malformed capability: not base64url")
    return raw
