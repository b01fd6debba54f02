"""Test helper: capabilities as an attacker handles them: read without checking, forged by changing payload fields
under the old signature, or genuine but expired."""

from __future__ import annotations

import base64
import json
import time

from pie_workers.wire.capability import mint
from support.sdk_host import TRUST

SECRET = TRUST.secret


def claims(token: str) -> list:
    """The payload of a token, [user, instance, expires, grants], read without checking anything."""
    payload = token.split(".")[0]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


def forged(token: str, **changes) -> str:
    """``token`` with fields of its payload changed (user, instance, expires, grants), its signature kept."""
    user, instance, expires, grants = claims(token)
    fields = {"user": user, "instance": instance, "expires": expires, "grants": grants} | changes
    payload = [fields["user"], fields["instance"], fields["expires"], fields["grants"]]
    payload = json.dumps(payload, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(payload).decode().rstrip("=") + "." + token.split(".")[1]


def expired(user: str, instance: str) -> str:
    """A capability minted with the cluster's secret whose lifetime is over."""
    token = mint(SECRET, user, instance, 0.01)
    time.sleep(0.02)
    return token
