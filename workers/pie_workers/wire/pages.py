"""Page arithmetic shared by the SDK, the engine and the runner: how many KV pages hold a number of tokens."""


def pages_for(tokens: int, page_size: int) -> int:
    """Pages needed to hold ``tokens`` tokens (a partly filled last page counts as one)."""
    return -(-tokens // page_size)
