"""One message-bus shard: an async Ray actor that owns a ZeroMQ ROUTER socket and the ``Topics`` behind it.

Wire protocol (msgpack; the client is ``inferlet.messaging``). A peer is one inferlet's DEALER socket; its routing
id is ``instance/session``. Each message from a peer has two parts: the instance's capability (minted by the trusted
host, see ``pie_workers.wire.capability``) and a frame. The capability must verify with the cluster's secret and
name the instance the routing id starts with; its user namespaces every topic the frame names. A frame that fails
this is not applied (nor read: the capability is checked first, its verification cached per token, so a peer's
identity costs one dict lookup per message): the peer is answered ``["refused", why]`` and loses what it held here,
and the refusal is logged at a bounded rate. This is the bus's handshake: ZeroMQ reconnects a peer by itself, to a
restarted shard too, so no first message of a connection is sure to reach the process that must see it, and each
message carries its proof instead. Each instance and user holds a bounded number of peers (routing ids) here
(``ConnectionLimits``: ``[limits] connections_per_instance``, ``connections_per_user``); an instance that ended is
refused from the moment the trusted side revokes it (``revoke``), and its peers lose what they held. A frame is a
list of operations, applied in order::

    ["push", topic, message, seq, first]     ["pull", topic, rid]    ["cancel", rid]
    ["cast", topic, message]                 ["sub", topic, sid]     ["unsub", sid]
    ["requeue", topic, message, seq, first]  a pulled message its puller no longer wanted: back to the queue's front
    ["withdraw", rid, token]     cancel, confirmed with ["ok", token] (a pull served in its own process)
    ["close", token]             drop everything the peer holds (its inferlet ended)

Each frame back is the list of every event the peer has coming from one burst: ``["pulled", rid, topic, message]``,
``["cast", sid, message]``, ``["ok", id]`` answering ``sub`` (id = sid) and ``close`` (id = token), ``["acked",
seq]`` and ``["resend", seq]`` (numbered operations are missing from ``seq`` on), ``["lost", rid, why]`` (pull
``rid``'s topic held messages lost with the node of the shard this one replaces), ``["over", why]`` (a push or cast
past a ``[limits]`` bound was not applied: ``quotas.py``).

Operations that hand the shard a message are numbered per peer (``seq``; ``first``: the lowest the peer has not seen
acknowledged). The shard applies them once each, in order: one it already applied is ignored, one past a gap is
ignored and the peer asked to send again from the gap (what the dead process had read but not applied, resent to
its restart). The last one applied is journaled with the burst's queue changes and acknowledged after the write.

The socket is served from the actor's event loop through ``add_reader``: a burst of frames is applied, then each
peer gets one frame — so when many messages are in flight, both directions batch by themselves. The ROUTER is
``ROUTER_MANDATORY``: a frame for a peer that is gone (or has stopped reading for ``SEND_HWM`` frames) fails to
send instead of vanishing, the peer's pulls and subscriptions are dropped, and the pulled messages in that frame go
back to the front of their queues, so a vanished puller does not lose messages.

Ray restarts a shard whose process dies. The restarted one listens on the addresses the first one had (kept in the
GCS's key-value store, ``GcsStore``), so every client's DEALER reconnects to it by itself and what they send from
then on is applied. Its queued messages it reads back from its journal on the node's disk (``journal.py``); the
waiting pulls and subscriptions the dead one held are gone, and each client fails its pulls and subscriptions on
that shard with an error saying so when its connection drops (``inferlet.messaging``), rather than waiting
forever. What a client had pushed that the dead process had not yet journaled, the client sends again.

A shard whose node is lost cannot be restarted there; the controller makes another in its place on a live node
(``handle.replace_shards``), told the actor it replaces, which listens at new addresses and fails the first pull on
each topic the lost one recorded as holding messages (``queued_topics.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import tempfile
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import ray
import zmq
from pie_workers.wire.admission import ConnectionLimits, RefusalLog, Revocation

from pie_cluster.bus.journal import Journal, NoJournal, Replayed
from pie_cluster.bus.peers import Peers
from pie_cluster.bus.queued_topics import SHRINK_S, QueuedTopics
from pie_cluster.bus.quotas import refusal
from pie_cluster.bus.topics import BusStats, Topics
from pie_cluster.gcs_store import GcsStore
from pie_cluster.limits import BusLimits

log = logging.getLogger(__name__)

SOCKET_NAME = "shard.sock"  # in the shard's own directory
BURST = 256  # frames applied per turn of the event loop, so the actor's Ray calls (stats, stop) still get a turn
SEND_HWM = 10_000  # frames queued towards one peer before it counts as gone
MAX_MESSAGE_BYTES = 256 << 20  # a ZeroMQ message past which its peer is disconnected unread
PEERS_NUMBERED = 1 << 16  # peers whose last applied number is kept (those gone without closing are forgotten first)


@dataclass(frozen=True)
class ShardInfo:
    """Where one shard listens: ``ipc`` for inferlets on its node, ``tcp`` for everyone else."""

    index: int
    count: int
    node_id: str
    tcp: str
    ipc: str
    secret_id: str  # names the cluster secret it verifies capabilities with (a digest, never the secret)


@dataclass(slots=True)
class _Outbox:
    """What one peer has coming from this burst, and whose topics it comes from (a routing id is one instance's,
    so one user's)."""

    user: str | None  # None until an event names it (a refusal does not)
    events: list = field(default_factory=list)


class BusShard:
    def __init__(
        self,
        index: int,
        count: int,
        secret: bytes,
        replaces: str | None = None,
        limits: BusLimits = BusLimits(),
        connections: ConnectionLimits | None = None,
    ):
        """``replaces``: the actor id of the shard this one replaces, whose node was lost (``handle.py``);
        ``limits``: what each user may put on it (``quotas.py``); ``connections``: the peers one instance and one
        user may hold here."""
        if not secret:
            raise ValueError("a bus shard needs the cluster's secret to verify its clients' capabilities")
        self.index, self.count = index, count
        self._limits = limits
        self._secret = secret
        self._peers = Peers(secret, connections or ConnectionLimits())
        self._refusals = RefusalLog(log)
        self._topics = Topics(self._queue_event)  # made again with its journal once the shard listens
        self._journal: Journal = NoJournal()  # its own once the shard listens
        self._applied: OrderedDict[bytes, int] = OrderedDict()  # peer -> its last numbered operation applied
        self._acks: set[bytes] = set()  # peers to acknowledge at the end of this burst
        self._resends: dict[bytes, int] = {}  # peer -> the number to send again from (this burst)
        self._asked: dict[bytes, int] = {}  # peer -> the number it was asked to send again from, until it does
        self._outgoing: dict[bytes, _Outbox] = {}
        self._queued_topics: QueuedTopics | None = None  # once it listens
        self._shrinking: asyncio.TimerHandle | None = None
        self._sock: zmq.Socket | None = None
        self._ipc_path = ""
        self._info: ShardInfo | None = None
        self._stored = GcsStore("pie-bus", ray.get_runtime_context().get_actor_id())  # the same after a restart
        self._replaced = GcsStore("pie-bus", replaces) if replaces else None
        if ray.get_runtime_context().was_current_actor_reconstructed:  # nobody calls start again: listen now
            self._listen(self._stored.get(()))
            log.warning("bus shard %d restarted at %s", index, self._info.tcp)

    async def start(self) -> ShardInfo:
        """Bind and start serving (once; later calls just report where the shard listens)."""
        if self._info is None:
            self._listen(self._replaced.get(()) if self._replaced is not None else None)
        return self._info

    def _listen(self, before: ShardInfo | None) -> None:
        """Bind (at ``before``'s addresses, where this is still its node) and serve from the event loop."""
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.LINGER, 0)
        # a message is read whole before its capability is checked: bounded, though above what a quota refuses
        sock.setsockopt(zmq.MAXMSGSIZE, max(MAX_MESSAGE_BYTES, 4 * self._limits.message_bytes))
        ip, node = ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()
        moved = before is not None and before.node_id != node  # its node was lost, with its journal
        self._queued_topics = QueuedTopics(self._stored, self._replaced if moved else None)
        if moved:
            log.warning(
                "bus shard %d replaces one whose node was lost: messages queued on %d topics were lost with node %s",
                self.index,
                self._queued_topics.lost,
                before.node_id,
            )
        if before is not None and before.node_id == node:
            tcp, self._ipc_path = before.tcp, before.ipc.removeprefix("ipc://")
            sock.bind(tcp)
            with contextlib.suppress(OSError):
                os.unlink(self._ipc_path)  # the dead process's socket file
        else:
            tcp = f"tcp://{ip}:{sock.bind_to_random_port(f'tcp://{ip}')}"
            # a directory of its own, which sandboxes bind in (not the socket file: they would keep seeing the dead
            # process's, where a restarted shard makes a new one)
            directory = Path(tempfile.gettempdir()) / f"pie-bus-{uuid.uuid4().hex[:12]}"
            directory.mkdir(mode=0o755)
            self._ipc_path = str(directory / SOCKET_NAME)
        sock.bind(f"ipc://{self._ipc_path}")
        os.chmod(self._ipc_path, 0o666)  # sandboxed workers have uids of their own; capabilities guard it
        # beside that directory, not in it: no sandbox may read the queued messages
        self._journal = Journal(Path(f"{Path(self._ipc_path).parent}.journal"), self._limits.journal_bytes)
        replayed = self._journal.replay()
        self._applied = replayed.applied
        self._topics = Topics(self._queue_event, self._journal, replayed.queues)
        self._sock = sock
        asyncio.get_running_loop().add_reader(sock.FD, self._serve)
        self._shrink()
        self._info = ShardInfo(self.index, self.count, node, tcp, f"ipc://{self._ipc_path}", secret_id(self._secret))
        self._stored.put((), self._info)

    async def stats(self, user: str | None = None) -> BusStats:
        return self._topics.stats(user)

    async def stop(self) -> None:
        if self._shrinking is not None:
            self._shrinking.cancel()
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.FD)
            self._sock.close()
            self._sock = None
            with contextlib.suppress(OSError):
                os.unlink(self._ipc_path)
                os.rmdir(Path(self._ipc_path).parent)
        self._journal.remove()

    # -- serving --

    def _serve(self) -> None:
        """Apply a burst of readable frames, then send each peer one frame with all it has coming."""
        sock = self._sock
        if sock is None:
            return
        for _ in range(BURST):
            try:
                peer, *parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                token, frame = parts
                user = self._peers.admit(peer, token)
            except (ValueError, PermissionError) as e:
                self._refuse(peer, e if isinstance(e, PermissionError) else "no capability was presented")
                continue
            self._apply(peer, user, frame)
        self._acknowledge()
        self._write_journal()  # before anyone is sent a message: one pulled is never handed out again
        self._send_outgoing()
        self._write_journal()  # messages given back by peers that are gone
        # ZeroMQ's FD is edge-triggered: what is still queued after our reads and sends won't signal again.
        if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            asyncio.get_running_loop().call_soon(self._serve)

    def _shrink(self) -> None:
        self._queued_topics.shrink(self._topics.holds)
        self._shrinking = asyncio.get_running_loop().call_later(SHRINK_S, self._shrink)

    def _write_journal(self) -> None:
        self._queued_topics.cover(self._journal.take_filled())  # before anything is acknowledged
        self._journal.flush(self._journal_state)

    def _in_order(self, peer: bytes, seq: int, first: int) -> bool:
        """Whether numbered operation ``seq`` of ``peer`` is the next one to apply (it then counts as applied)."""
        expected = self._applied.get(peer, first - 1) + 1
        if seq != expected:
            if seq > expected and self._asked.get(peer) != expected:  # ask once per gap, not per operation past it
                self._asked[peer] = self._resends[peer] = expected
            self._acks.add(peer)  # a resent one already applied: tell the peer again
            return False
        if self._asked:
            self._asked.pop(peer, None)
        self._applied[peer] = seq
        self._applied.move_to_end(peer)
        self._acks.add(peer)
        return True

    def _acknowledge(self) -> None:
        """Journal each peer's last applied number and queue its acknowledgement (sent after the journal write)."""
        while len(self._applied) > PEERS_NUMBERED:
            self._applied.popitem(last=False)
        for peer in self._acks:
            seq = self._applied.get(peer)
            if seq is not None:
                self._journal.applied(peer, seq)
                self._queue_event(peer, None, ["acked", seq])
        for peer, seq in self._resends.items():
            self._queue_event(peer, None, ["resend", seq])
        self._acks.clear()
        self._resends.clear()

    def _refuse(self, peer: bytes, why: object, logged: bool = True) -> None:
        """Tell the peer why its frame was not applied; what it held here is dropped."""
        if logged:
            self._refusals.refused(f"a frame from {peer!r} on bus shard {self.index}", why)
        self._forget(peer)
        self._queue_event(peer, None, ["refused", str(why)])

    def _forget(self, peer: bytes) -> None:
        """The peer is gone, refused or closed: it holds nothing here and counts against no bound."""
        self._topics.drop(peer)
        self._peers.leave(peer)

    async def revoke(self, revocation: Revocation) -> None:
        """A minter says which of its instances ended (``wire/admission.py``): their capabilities are refused from
        now on, and their peers are told so and lose what they held here."""
        for peer in self._peers.revoke(revocation):
            self._refuse(peer, f"revoked capability: instance {peer.split(b'/')[0].decode()!r} has ended", logged=False)
        if self._sock is not None:
            self._serve()  # sends the refusals (and applies whatever arrived meanwhile)

    def _apply(self, peer: bytes, user: str, frame: bytes) -> None:
        """A malformed frame or operation is the sender's bug: it is logged and skipped, never fatal to the shard."""
        try:
            ops = msgpack.unpackb(frame)
        except Exception:
            log.exception("bus shard %d: unreadable frame from %r", self.index, peer)
            return
        for op in ops:
            try:
                self._operate(peer, user, op)
            except Exception:
                log.exception("bus shard %d: bad operation from %r", self.index, peer)

    def _operate(self, peer: bytes, user: str, op: list) -> None:
        topics = self._topics
        match op:
            case ["push", str(topic), str(message), int(seq), int(first)]:
                if self._in_order(peer, seq, first):
                    self._push(peer, (user, topic), message)
            case ["pull", str(topic), int(rid)]:
                if self._queued_topics.take_lost((user, topic)):
                    self._queue_event(peer, user, ["lost", rid, _lost(topic)])
                else:
                    topics.pull(peer, user, rid, (user, topic))
            case ["cast", str(topic), str(message)]:
                if (why := refusal(self._limits, topics, (user, topic), message, push=False)) is not None:
                    self._queue_event(peer, user, ["over", why])
                else:
                    topics.broadcast((user, topic), message)
            case ["cancel", int(rid)]:
                topics.cancel(peer, rid)
            case ["withdraw", int(rid), int(token)]:
                topics.cancel(peer, rid)
                self._queue_event(peer, user, ["ok", token])
            case ["sub", str(topic), int(sid)]:
                topics.subscribe(peer, user, sid, (user, topic))
                self._queue_event(peer, user, ["ok", sid])
            case ["unsub", int(sid)]:
                topics.unsubscribe(peer, sid)
            case ["requeue", str(topic), str(message), int(seq), int(first)]:
                if self._in_order(peer, seq, first):
                    topics.requeue((user, topic), [message])
            case ["close", int(token)]:
                self._forget(peer)
                last = self._applied.pop(peer, None)
                if last is not None:  # acknowledged here: past this, the peer is not known
                    self._queue_event(peer, user, ["acked", last])
                    self._journal.applied(peer, None)
                self._queue_event(peer, user, ["ok", token])
            case _:
                raise ValueError(f"unknown bus operation {op!r}")

    def _push(self, peer: bytes, key: tuple[str, str], message: str) -> None:
        """Queue (or hand over) a pushed message, or tell the pusher which limit refuses it (``quotas.py``); the
        journal is compacted rather than let past its bound."""
        why = refusal(self._limits, self._topics, key, message)
        if why is not None:
            self._queue_event(peer, key[0], ["over", why])
            return
        self._topics.push(key, message)
        self._journal.bound(self._journal_state)

    def _journal_state(self) -> Replayed:
        return Replayed(self._topics.queued_messages(), self._applied)

    def _queue_event(self, peer: bytes, user: str | None, event: list) -> None:
        box = self._outgoing.get(peer)
        if box is None:
            box = self._outgoing[peer] = _Outbox(user)
        elif user is not None:
            box.user = user
        box.events.append(event)

    def _send_outgoing(self) -> None:
        while self._outgoing:
            peer, box = self._outgoing.popitem()
            try:
                self._sock.send_multipart([peer, msgpack.packb(box.events)], zmq.NOBLOCK)
            except zmq.ZMQError:  # EHOSTUNREACH: the peer is gone; EAGAIN: it stopped reading
                self._lost(peer, box)

    def _lost(self, peer: bytes, box: _Outbox) -> None:
        """Drop a peer that cannot be reached; the messages it was handed go back to the front of their queues."""
        self._forget(peer)
        returned: dict[str, list[str]] = {}
        for event in box.events:
            if event[0] == "pulled":
                returned.setdefault(event[2], []).append(event[3])
        for topic, messages in returned.items():
            self._topics.requeue((box.user, topic), messages)


def _lost(topic: str) -> str:
    return (
        f"messages queued on topic {topic!r} may have been lost: the bus shard that held them was restarted on "
        "another node after its node was lost (pull again for the messages pushed since)"
    )


def secret_id(secret: bytes) -> str:
    """A name for the cluster secret that reveals nothing of it: tells whether a running bus shares ours."""
    return hashlib.sha256(b"pie-secret-id." + secret).hexdigest()[:16]
