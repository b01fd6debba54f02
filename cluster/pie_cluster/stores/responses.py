"""The records of stored Responses-API responses, per user, outside the ingress: a named actor of the cluster.

Why an actor beside the directory rather than the ingress's memory or bare entries in Ray's internal KV: a record
is worth only as much as the snapshot it names, whose lineage the directory keeps; a record kept like the directory's
entries, created and stopped by the controller like the directory, outlives an ingress restart or an ingress replica
per request, and expires together with its snapshot (which takes something to sweep). A sweeper deletes
expired records and their snapshots (through the directory, which has the holding replica drop the pages); a record
past its expiry is gone for readers even before the sweeper runs.

Its records are durable like the directory's entries: each change is written through to the GCS's key-value store
(``DurableDict``), and Ray restarts the store when its process dies, on any node (it prefers the controller's), with
the records it had, so a stored conversation continues after its death, and, with GCS fault tolerance, after the
GCS's restart.

A record's snapshot does not exist yet while the turn's program is parked in the ingress that served it, its
context live (``saved`` False: a continuation elsewhere renders the history); the ingress reports ``saved`` once
the program, idle, has saved it.

Snapshots are not contexts: the market neither prices nor suspends them, so a stored conversation would hold its
pages until it expires. The store therefore keeps a turn resident only for ``resident_s``: then the directory has
its holder release the pages while the name stays (``UserDirectory.release``). Releasing a turn as soon as it is
continued would save little (consecutive turns' snapshots share all but their last, partly filled page) for two
more actor calls per turn. Its committed pages become prefix cache, evicted least recently used
first when memory is short and reused while they last; a continuation recomputes whatever is gone from the lineage.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import ray
from inferlet.responses_schema import snapshot_name

from pie_cluster.config import ResponsesConfig
from pie_cluster.gcs_store import DurableDict, GcsStore

RESPONSES = "pie-responses"
SWEEP_EVERY_S = 1.0


@dataclass
class ResponseRecord:
    """One response: who owns it, what it answered (the OpenAI object), and how to continue its conversation."""

    id: str
    user: str
    model: str
    body: dict  # the response object as the API answers it
    previous_id: str | None
    header: str  # ResponsesRequest.header() of the request: what the stored context begins with
    input_items: list[dict]  # the request's items, for a continuation that must re-render the history
    instance: str | None = None  # the serving instance while in progress
    pending: list[int] = field(default_factory=list)  # tokens closing the turn, not in the snapshot's KV
    call_names: dict[str, str] = field(default_factory=dict)  # the output's calls by call id
    expires_at: float = 0.0
    resident_until: float = 0.0  # its snapshot's pages are released after this (0: released already)
    saved: bool = True  # its snapshot exists (False while its program is parked: then the history renders it)

    @property
    def status(self) -> str:
        return self.body.get("status", "in_progress")

    @property
    def output_items(self) -> list[dict]:
        return self.body.get("output", [])


class ResponseStore:
    def __init__(self, config: ResponsesConfig, directory, namespace: str = "pie") -> None:
        self._config = config
        self._directory = directory
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self._records: DurableDict = DurableDict(GcsStore(f"pie-responses/{namespace}", "records"), restarted)
        self._sweeper: asyncio.Task | None = None
        if self._records:
            self._start_sweeper()

    async def put(self, record: ResponseRecord) -> None:
        """Add or replace a record; its expiry starts now. An in-progress record never replaces a finished one (the
        ingress does not wait for the first put, so it may arrive last), and nothing replaces a cancelled one (its
        snapshot is gone, even if the turn finished as it was cancelled)."""
        kept = self._records.get(record.id)
        if kept is not None and kept is not record and kept.status == "cancelled":
            return
        if record.status == "in_progress" and kept is not None and kept.status != "in_progress":
            return
        self._start_sweeper()
        now = time.time()
        record.expires_at = now + self._config.ttl_s
        record.resident_until = now + self._config.resident_s
        self._records[record.id] = record

    async def put_many(self, records: list[ResponseRecord]) -> list[None]:
        """``put`` each (what the ingress's turns finishing together send as one call)."""
        return [await self.put(record) for record in records]

    async def begin_many(self, continuations: list[tuple[str, str, ResponseRecord | None]]) -> list:
        """For each ``(user, previous_id, record)``, a continuation's two steps in one: the user's response it
        continues (None: none such), and, when that one is finished, ``record`` (the continuation, in progress)
        put."""
        found = []
        for user, previous_id, record in continuations:
            previous = await self.get(user, previous_id)
            if record is not None and previous is not None and previous.status in ("completed", "incomplete"):
                await self.put(record)
            found.append(previous)
        return found

    async def saved(self, user: str, model: str, response_id: str) -> None:
        """The parked program of a response saved its snapshot; a record deleted meanwhile has it removed."""
        record = await self.get(user, response_id)
        if record is None:
            with contextlib.suppress(ray.exceptions.RayError):
                self._directory.remove.remote(model, user, snapshot_name(response_id))
            return
        record.saved = True
        record.resident_until = time.time() + self._config.resident_s
        self._saved(record)

    async def get(self, user: str, response_id: str) -> ResponseRecord | None:
        """The user's record (another user's, or an expired one, is None)."""
        record = self._records.get(response_id)
        if record is None or record.user != user or record.expires_at <= time.time():
            return None
        return record

    async def history(self, user: str, response_id: str) -> list[dict]:
        """The conversation's items up to and including the response: each turn's input, then its output."""
        items: list[dict] = []
        record = await self.get(user, response_id)
        while record is not None:
            items[:0] = record.input_items + record.output_items
            record = await self.get(user, record.previous_id) if record.previous_id else None
        return items

    async def delete(self, user: str, response_id: str) -> ResponseRecord | None:
        """Remove the user's record and its snapshot; the removed record, or None if there was none."""
        record = await self.get(user, response_id)
        if record is not None:
            self._drop(record)
        return record

    async def fail(self, record: ResponseRecord) -> None:
        """The turn ended without finishing (failed, cancelled, its client gone): keep the record (a cancelled one
        stays cancelled) and drop whatever snapshot it may have saved."""
        await self.put(record)
        record = self._records.get(record.id, record)
        record.resident_until = 0.0  # nothing left to release
        self._saved(record)
        self._forget_snapshot(record)

    def _saved(self, record: ResponseRecord) -> None:
        """A record changed in place: write it through (if it is still kept)."""
        if record.id in self._records:
            self._records.changed(record.id)

    def _drop(self, record: ResponseRecord) -> None:
        """Forget the record and its snapshot, whether or not the turn got as far as saving one."""
        self._records.pop(record.id, None)
        self._forget_snapshot(record)

    def _release(self, record: ResponseRecord) -> None:
        record.resident_until = 0.0
        self._saved(record)
        with contextlib.suppress(ray.exceptions.RayError):
            self._directory.release.remote(record.model, record.user, snapshot_name(record.id))

    def _forget_snapshot(self, record: ResponseRecord) -> None:
        with contextlib.suppress(ray.exceptions.RayError):
            self._directory.remove.remote(record.model, record.user, snapshot_name(record.id))

    def _start_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        while self._records:
            now = time.time()
            for record in [r for r in self._records.values() if r.expires_at <= now]:
                self._drop(record)
            for record in self._records.values():
                if 0 < record.resident_until <= now and record.status != "in_progress":
                    self._release(record)
            await asyncio.sleep(SWEEP_EVERY_S)


def get_or_create_store(
    namespace: str, config: ResponsesConfig, directory, lifetime: str | None = None, placement: dict | None = None
):
    """The response store of ``namespace``, restarted by Ray whenever its process dies (its records are durable);
    calls in flight then are sent again to the restart."""
    options = {
        "name": RESPONSES,
        "namespace": namespace,
        "get_if_exists": True,
        "lifetime": lifetime,
        "num_cpus": 0,
        "max_restarts": -1,
        "max_task_retries": -1,
    }
    return ray.remote(ResponseStore).options(**options, **(placement or {})).remote(config, directory, namespace)
