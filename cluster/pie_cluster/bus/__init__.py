"""The message bus: push/pull queues and broadcast/subscribe topics shared by every inferlet in the cluster.

The SDK side is ``inferlet.messaging`` (its docstring states the delivery rules). Here live the shards and the
handle to start, find, inspect and stop them::

    bus = start_bus(secret=secret)           # get-or-create shard actors "pie-bus-0..N-1" in the caller's namespace
    await run_inferlet(main, input, endpoints, user, instance_id=i, capability=c, bus=bus.addresses())  # ipc/tcp
    bus.stats(user)                          # BusStats: sessions / topics / queued / waiters / subscriptions
    find_bus()                               # the same handle, from any job or task

Why this shape:

* Shards are named async Ray actors (``num_cpus=0``, spread over nodes), so any job finds them by name and Ray
  places and supervises them; but messages do not travel as Ray calls (one costs 0.6-1 ms; ``ray.util.queue.Queue``
  manages a few hundred messages/s here). Each shard owns a ZeroMQ ROUTER socket (tcp for every node, ipc for its
  own) and each inferlet a DEALER per shard it uses; frames are msgpack lists of operations/events. Both sides batch
  by themselves: the SDK sends what an event-loop turn produced as one frame, and a shard answers each peer once per
  burst of frames it read. ``bench/bus.py`` on the 2-core dev box (other jobs running, load ~10): ~100k messages/s
  push->pull with 64 pulls in flight, ~12k/s with one pull at a time (each pull is a round trip), 0.5M broadcast
  deliveries/s, ping-pong round trip 0.18 ms median across processes — against 770 messages/s and 4 ms for
  ``ray.util.queue.Queue``.
* Inside one process (one user's sandboxed inferlets on a node) a push meets a pull waiting there without the
  shard: the SDK hands it over and withdraws the pull from the shard (``inferlet.messaging``'s rules). On two busy
  cores a trip through the shard's process took 5-17 ms p50 between a swarm's agents (``bench/agents.py``).
* A topic lives on shard ``crc32(user, topic) % shards``: one topic is one shard's single-threaded state, which is
  what makes its order total and each message's hand-off atomic; more topics spread over more shards.
* Exactly once, FIFO: ZeroMQ delivers a connection's frames in order, once, without drops (a DEALER blocks rather
  than drop); a shard applies operations in arrival order, and a message leaves its queue only by being handed to
  exactly one waiting pull, oldest waiter first. A pull cancelled while its answer is in flight gives the message
  back to the front of the queue; an inferlet that ends withdraws its pulls in one round trip per shard and gives
  back what arrived meanwhile; a peer that vanished is noticed when a frame to it fails (``ROUTER_MANDATORY``) and
  the messages in that frame are requeued. A shard journals its queues on its node's disk and acknowledges pushes
  after the write, and clients send unacknowledged pushes again (``shard.py``), so Ray's restart of a dead shard at
  its addresses keeps its queued messages; clients reconnect by themselves, and their pulls and subscriptions on it
  fail with a ``BusError`` saying so. A shard whose node is lost is made again on another by the controller
  (``replace_shards``); sandboxed inferlets reach it through their host's relay, which follows it. What is lost:
  messages in flight inside an inferlet's process that dies, and a shard's queues with its node, which its
  replacement reports (``queued_topics.py``: the first pull on each topic that held messages fails saying so).
* Overflow: subscription buffers live in the subscribing inferlet (1024 unread; the oldest is dropped and counted),
  so a slow reader never slows the shard or other subscribers. Queues are bounded per user and shard, and so are a
  message and a shard's journal on disk (``quotas.py``, ``[limits]``): a push past a bound fails in the pushing
  inferlet with a ``QuotaExceeded`` naming it, and nothing queued is ever dropped for it.
* Namespacing: every frame carries the instance's capability (minted by the trusted host with the cluster's
  secret, which the shards hold); the shard takes the user from it alone and keys every topic by (user, topic). A
  peer's routing id must be one of the capability's instance, so no inferlet can act as another's connection.
"""

from pie_cluster.bus.handle import Bus, find_bus, replace_shards, start_bus
from pie_cluster.bus.topics import BusStats

__all__ = ["Bus", "BusStats", "find_bus", "replace_shards", "start_bus"]
