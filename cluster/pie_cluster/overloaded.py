"""``Overloaded``: what a part of the cluster raises when it holds all it may for now and the caller should retry
later (HTTP 429 with ``Retry-After``): the launcher's admission queues, an instance's inbox on its host."""


class Overloaded(Exception):
    """At a limit of what may run, wait or be held; retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message, retry_after_s)  # both in args, so it crosses Ray (pickling) intact

    @property
    def retry_after_s(self) -> float:
        return self.args[1]

    def __str__(self) -> str:
        return self.args[0]
