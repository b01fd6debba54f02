"""Uploaded inferlets run here: sandboxed worker processes, one set per user, kept by each node's trusted host.

The host (a Ray actor, trusted) never runs user code itself when the sandbox is on. It starts plain OS processes
under bubblewrap (``bwrap.py``) — their own network, PID, IPC and mount namespaces, their own uid where the host can
give one, a read-only view of the Python environment and of the user's programs, a private scratch ``/tmp``, and
kernel limits on memory, CPU time, processes and file size — and talks to each over a socket pair
(``protocol.py``). A worker serves one user's instances (``worker_main.py``); it reaches the replicas and bus
shards only through the Unix sockets the host binds into it (``relay.py`` carries those of other nodes), and every
connection it makes presents a capability the host minted for one instance. ``pool.py`` keeps each user's workers,
reuses them across launches, and ends a worker that stalls, dies or outgrows its limits, failing only its own
instances.
"""


class SandboxUnavailable(RuntimeError):
    """The kernel or the installation cannot run the sandbox; the message names the fix."""
