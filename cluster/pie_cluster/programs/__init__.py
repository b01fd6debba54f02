"""Inferlet programs: what users upload, how a host turns one into ``main``, the store that keeps them, and
the cluster's built-in programs (``builtin/``, source files loaded like any upload)."""

from pathlib import Path

BUILTIN_DIR = Path(__file__).parent / "builtin"
"""The cluster's own programs, as source files."""
OPENAI_PROGRAM = "pie:openai-completions"
"""The built-in program serving the OpenAI-compatible routes, launched by this id like any uploaded program."""
RESPONSES_PROGRAM = "pie:openai-responses"
"""The built-in program serving ``POST /v1/responses``: one turn of a conversation kept as a snapshot."""
BUILTINS = {
    OPENAI_PROGRAM: BUILTIN_DIR / "openai_completions.py",
    RESPONSES_PROGRAM: BUILTIN_DIR / "openai_responses_api.py",
}
"""The built-in programs' ids and sources."""
