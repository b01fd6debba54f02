"""What ``pie start`` remembers for the other commands: ``$PIE_HOME/cluster.json`` (default ``~/.pie``)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def state_path() -> Path:
    return Path(os.environ.get("PIE_HOME", Path.home() / ".pie")) / "cluster.json"


def load_state() -> dict:
    try:
        return json.loads(state_path().read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def save_state(state: dict) -> None:
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(state, indent=2))
    path.chmod(0o600)  # it may hold a bearer token


def clear_state() -> None:
    state_path().unlink(missing_ok=True)
