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
    # it may hold a bearer token: its owner's alone from the start (chmod after writing leaves a moment open)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        os.fchmod(f.fileno(), 0o600)  # a file left by an older version keeps its mode through open()
        f.write(json.dumps(state, indent=2))


def clear_state() -> None:
    state_path().unlink(missing_ok=True)
