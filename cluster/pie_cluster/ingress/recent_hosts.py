"""Which node host took a user's last session message to an instance, so the next one goes straight there.

A client that feeds a long-lived inferlet posts message after message to it; asking the launcher where the instance
runs before each one put a central actor on every message's path. The ingress replica keeps the answer instead: a
host checks whose instance it is (``hosts/events.py``), so a remembered host can only deliver what the launcher
would have; one that no longer runs the instance (it ended, or was moved) or is gone makes the ingress ask again.
"""

from __future__ import annotations

from collections import OrderedDict

REMEMBERED = 4096  # (user, instance) pairs: the most recently used are kept


class RecentHosts:
    def __init__(self, capacity: int = REMEMBERED):
        self._hosts: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._capacity = capacity

    def get(self, key: tuple[str, str]):
        host = self._hosts.get(key)
        if host is not None:
            self._hosts.move_to_end(key)
        return host

    def remember(self, key: tuple[str, str], host) -> None:
        self._hosts[key] = host
        self._hosts.move_to_end(key)
        while len(self._hosts) > self._capacity:
            self._hosts.popitem(last=False)

    def forget(self, key: tuple[str, str]) -> None:
        self._hosts.pop(key, None)
