"""Programs as clients upload them: zipped directories with a ``pie.toml``, for the tests of the launcher's paths."""

from __future__ import annotations

import io
import textwrap
import zipfile


def zip_program(files: dict[str, str]) -> bytes:
    """A zip of ``files`` (name -> source, dedented)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, text in files.items():
            z.writestr(name, textwrap.dedent(text))
    return buf.getvalue()


def isolated_shouter(reports: str) -> bytes:
    """``shouter@1.2.3``, an isolated two-module program returning the shouted ``input["text"]`` and, as
    ``process``, ``os.<reports>()``: which process ran it."""
    main = f"""
    import os
    from .helpers import shout

    async def main(input):
        return {{"text": shout(input["text"]), "process": os.{reports}()}}
    """
    manifest = """
    [package]
    name = "shouter"
    version = "1.2.3"
    [inferlet]
    isolated = true
    """
    return zip_program({"pie.toml": manifest, "main.py": main, "helpers.py": "def shout(s):\n    return s.upper()\n"})
