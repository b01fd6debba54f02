"""The built-in inferlet behind ``POST /v1/responses``: one instance per turn, run like any user's inferlet (same
engine, market and accounting). The work is in ``inferlet.responses``."""

from inferlet import responses


async def main(input: dict) -> dict:
    return await responses.serve(input)
