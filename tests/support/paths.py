"""Where the repository's parts are, for the tests that read or run its files."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SUPPORT = ROOT / "tests" / "support"
