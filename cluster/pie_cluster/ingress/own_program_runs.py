"""The records ``ingress.own_programs`` keeps: one per instance it runs, and what the launcher last said each user may
still start.

An instance of the cluster's own programs may begin before the launcher has admitted it — its program renders
the prompt and prefills while the admission call is on its way — when the launcher's last answers left its user
room to start one more. Until the answer comes the run is *unconfirmed*: it may emit events, but its ending is
held back (the launcher must hear of an instance's admission before its end); if the answer is a refusal or a
place in the queue, the run is undone and nothing it did is seen.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from pie_cluster.launcher.records import AdmissionAnswer, Admitted


@dataclass
class LocalRun:
    """One instance run in this process."""

    instance_id: str
    services_version: int  # the services it runs with (the launcher's version of them)
    deadline_s: float | None
    wallet: object | None = None  # its market wallet while this process holds it (then ``run_inferlet`` does)
    confirmed: bool = True  # the launcher admitted it (False: begun before its answer came)
    task: asyncio.Task | None = None
    held_ending: tuple[str, str | bytes] | None = None  # its terminal event, held until it is confirmed
    abort_reason: str | None = None

    def admitted_as_begun(self, answer: AdmissionAnswer) -> bool:
        """Whether the launcher's answer lets this run, begun early, go on: admitted to run now, with the services
        and limits it began with."""
        return (
            isinstance(answer, Admitted)
            and not answer.queued
            and answer.ending is None
            and answer.services == self.services_version
            and answer.deadline_s == self.deadline_s
        )


@dataclass
class _UserRoom:
    spare: int = 0  # more instances the launcher's last answer let this user start without waiting
    unanswered: int = 0  # begun early since then, their answers not back yet


class Headroom:
    """How many instances each user may begin before their admission answers: what the launcher's last answer
    for that user said they could start, less those begun early since."""

    def __init__(self) -> None:
        self._users: dict[str, _UserRoom] = {}
        self.deadline_s: float | None = None  # the limit the launcher gives these instances (the same for all)
        self.services_version: int | None = None  # the services' version in the launcher's last answer

    def take(self, user: str) -> bool:
        """Take room for one early start of ``user``'s; False when there is none (or nothing was heard yet)."""
        room = self._users.get(user)
        if room is None or room.spare <= room.unanswered:
            return False
        room.unanswered += 1
        return True

    def answered(self, user: str) -> None:
        """An early start's answer came (whatever it was)."""
        self._users[user].unanswered -= 1

    def heard(self, user: str, answer: AdmissionAnswer) -> None:
        """An admission answer for ``user``: the room it leaves, and the limits its instances run with (a refusal
        leaves none)."""
        room = self._users.setdefault(user, _UserRoom())
        room.spare = answer.spare if isinstance(answer, Admitted) else 0
        if isinstance(answer, Admitted):
            self.deadline_s, self.services_version = answer.deadline_s, answer.services
