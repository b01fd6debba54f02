"""What a client asks for when it launches an inferlet: one record shared by the HTTP app, the Python client,
``pie submit``, Ray jobs and the launcher, so the fields, their limits and their meaning are written once.

Limits are checked where the request enters (pydantic validation): a budget or deadline out of range is refused
with a message naming the field, never carried into the market or the host.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

MAX_DEADLINE_S = 7 * 24 * 3600.0
"""A week: longer deadlines are almost certainly a unit mistake (milliseconds for seconds)."""

MAX_TOKEN_BUDGET = 10**12
"""Far beyond what any instance can generate, and small enough that its credits stay exact in the market."""


class LaunchRequest(BaseModel):
    """One launch of an uploaded program."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    program: str = Field(min_length=1, max_length=1024, description="program id returned by POST /v1/programs")
    input: dict[str, Any] = Field(default_factory=dict, description="the inferlet's input object")
    deadline_s: float | None = Field(
        None, gt=0, le=MAX_DEADLINE_S, description="abort the instance after this many seconds"
    )
    node_id: str | None = Field(
        None, max_length=128, description="run on this Ray node (default: near the models, least busy)"
    )
    token_budget: int | None = Field(
        None,
        ge=0,
        le=MAX_TOKEN_BUDGET,
        description="tokens the instance may have the model generate (enforced by the replicas) and spend on the "
        "KV-page market: it is endowed with one credit per page of them, at most the cluster's [limits] "
        "max_endowment (default: the cluster's default endowment)",
    )


def describe_errors(errors: list[dict]) -> str:
    """Pydantic's (or FastAPI's) validation errors as one line that names each bad field, e.g.
    ``deadline_s: Input should be less than or equal to 604800`` (never the rejected input itself)."""
    parts = []
    for error in errors:
        if error.get("type") == "json_invalid":  # its location is a character offset, not a field
            parts.append(f"the body is not valid JSON ({error.get('ctx', {}).get('error', 'cannot parse it')})")
            continue
        where = ".".join(str(p) for p in error.get("loc", ()) if p not in ("body", "query", "path", "header"))
        parts.append(f"{where}: {error.get('msg', 'invalid')}" if where else str(error.get("msg", "invalid")))
    return "; ".join(parts) or "invalid request"
