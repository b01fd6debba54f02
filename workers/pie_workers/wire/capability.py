"""Capabilities: who an inferlet instance is, minted by the trusted side and checked by everything it connects to.

User code runs in sandboxed processes, so nothing it says about itself can be believed. The trusted host that
launches an instance mints a token binding (user, instance, expiry) with the cluster's secret; replicas and bus
shards hold the same secret and take user and instance from a token that verifies, never from a name the client
sends. The token is printable and has no ``/`` (it travels inside the replica channel's session strings)::

    base64url(json [user, instance, expires]) "." base64url(HMAC-SHA256(secret, DOMAIN + payload))

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

DOMAIN = b"pie-capability-v1."
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


def mint(secret: bytes, user: str, instance: str, ttl_s: float) -> str:
    """A token saying that ``instance`` runs as ``user`` for the next ``ttl_s`` seconds."""
    if not secret:
        raise ValueError("a capability needs the cluster's secret; an empty one would prove nothing")
    if not math.isfinite(ttl_s) or ttl_s <= 0:
        raise ValueError(f"a capability's lifetime is a positive number of seconds, not {ttl_s!r}")
    payload = _encode(json.dumps([user, instance, time.time() + ttl_s], separators=(",", ":")).encode())
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
        user, instance, expires = json.loads(claims)
    except (ValueError, TypeError):
        raise CapabilityError("malformed capability: its payload is not [user, instance, expiry]") from None
    if not (isinstance(user, str) and isinstance(instance, str) and isinstance(expires, (int, float))):
        raise CapabilityError("malformed capability: its payload is not [user, instance, expiry]")
    if (time.time() if now is None else now) >= expires:
        raise CapabilityError(f"expired capability: instance {instance!r} of user {user!r} is past its lifetime")
    return Capability(user, instance, float(expires))


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
