"""The built-in inferlet behind ``/v1/chat/completions`` and ``/v1/completions``: one instance per request, run
like any user's inferlet (same engine, market and accounting). The work is in ``inferlet.completions``."""

from inferlet import completions


async def main(input: dict) -> dict:
    return await completions.serve(input)
