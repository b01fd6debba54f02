"""The cluster services across nodes, on a real two-node Ray cluster (a controller with a replica on each node):
a launch returns what `pie run` returns, each node's replica loads its own copy and serves its node's inferlets,
snapshots and adapters made on one node are the same on the other, a placement Ray could never satisfy is refused,
inferlets on different nodes talk over the bus, and a replica killed mid-generation fails only its inferlets and is
replaced. What the launcher does with one instance (sessions, ends, budgets, users, programs) is in
``test_launcher.py``.

One module of ~650 lines on purpose: its tests share one two-node cluster, whose start costs ~30 CPU-seconds.
"""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import pytest
import ray
from pie_cluster.config import AuthConfig, ModelConfigEntry, PieConfig
from pie_cluster.control.controller import Controller
from support.launching import engine_stats, launch, run_to_end, upload

LAUNCHER_LIMITS = {"max_running_per_user": 10, "max_queued_per_user": 4}  # filled by the restart and lease tests

GREEDY = """
from inferlet import Context, Model, Sampler

async def main(input):
    model = Model.load("default")
    with Context(model) as ctx:
        ctx.user(input["prompt"])
        tokens = await ctx.generate(Sampler.argmax(), max_tokens=input["n"]).collect_tokens()
    return {"tokens": tokens}
"""


def test_launch_runs_the_program_and_returns_what_pie_run_returns(cluster, launcher, served):
    from pie_cluster.programs.program import Program

    program = upload(launcher, GREEDY)
    instance = launch(launcher, program, {"prompt": "hello there", "n": 12})
    events = run_to_end(launcher, instance)
    assert [e[1] for e in events] == ["return"]
    main = Program.from_upload("prog.py", textwrap.dedent(GREEDY).encode()).load_main()
    direct = served.run(main, {"prompt": "hello there", "n": 12})
    import json

    assert json.loads(events[0][2]) == direct and len(direct["tokens"]) == 12


def test_replicas_on_two_nodes_each_load_their_own_copy_and_serve_their_nodes_inferlets(
    cluster, launcher, served, second_node_cache
):
    import hashlib
    import json

    from pie_cluster.programs.program import Program

    second = ray.get(
        ray.remote(lambda: ray.get_runtime_context().get_node_id()).options(resources={"second_node": 0.01}).remote()
    )
    replicas = {r.node: r for r in engine_stats(cluster)}
    assert sorted(replicas) == sorted(ray.get(cluster.nodes.remote()))  # one replica on each node
    (head,) = set(replicas) - {second}
    # The embedded model was built on each node, in that node's cache, byte for byte the same.
    assert Path(replicas[second].model_dir).is_relative_to(second_node_cache)
    assert not Path(replicas[head].model_dir).is_relative_to(second_node_cache)
    weights = [
        hashlib.sha256((Path(replicas[n].model_dir) / "model.safetensors").read_bytes()).digest() for n in replicas
    ]
    assert weights[0] == weights[1]

    program = upload(launcher, GREEDY)
    main = Program.from_upload("prog.py", textwrap.dedent(GREEDY).encode()).load_main()
    expected = served.run(main, {"prompt": "two nodes", "n": 10})
    for node in (head, second):
        before = {r.node: r.batches for r in engine_stats(cluster)}
        instance = launch(launcher, program, {"prompt": "two nodes", "n": 10}, node_id=node)
        assert json.loads(run_to_end(launcher, instance)[-1][2]) == expected
        after = {r.node: r.batches for r in engine_stats(cluster)}
        assert after[node] > before[node]  # served by its own node's replica...
        assert all(after[n] == before[n] for n in after if n != node)  # ...and by no other


SNAPSHOTS = """
from inferlet import Context, Model, Sampler

async def continuation(ctx):
    return await ctx.generate(Sampler.argmax(), max_tokens=8, stop=[]).collect_tokens()

async def main(input):
    model, op, name = Model.load("default"), input["op"], input.get("name")
    if op == "save":
        with Context(model) as ctx:
            ctx.user(input["text"] * 3)
            await ctx.flush()
            ctx.save(name)
            return {"seq_len": ctx.seq_len, "tokens": await continuation(ctx)}
    if op in ("open", "take"):
        ctx = Context.open(model, name) if op == "open" else Context.take(model, name)
        if ctx is None:
            return None
        with ctx:
            return {"seq_len": ctx.seq_len, "tokens": await continuation(ctx)}
    Context.delete(model, name)
    return {"deleted": name}
"""


def node_pair(cluster) -> tuple[str, str]:
    """(head node, second node), each serving one replica."""
    second = ray.get(
        ray.remote(lambda: ray.get_runtime_context().get_node_id()).options(resources={"second_node": 0.01}).remote()
    )
    (head,) = set(ray.get(cluster.nodes.remote())) - {second}
    return head, second


def test_the_user_directory_restarts_with_every_snapshot_name_it_held(cluster, launcher, ray_cluster):
    """SIGKILL the directory: Ray restarts it, and it reads its entries back from the GCS's key-value store, so a
    snapshot saved before opens on the other node (recomputed from the lineage it kept) and its name stays taken."""
    import os
    import signal

    from pie_cluster.stores.directory import DIRECTORY
    from ray.util.state import list_actors

    head, second = node_pair(cluster)
    program = upload(launcher, SNAPSHOTS)

    def run(op: str, node: str, **input):
        last = run_to_end(launcher, launch(launcher, program, {"op": op, "name": "durable", **input}, node_id=node))
        return last[-1]

    saved = run("save", head, text="Kept through a restart. ")
    (directory,) = list_actors(ray_cluster.address, filters=[("name", "=", DIRECTORY), ("state", "=", "ALIVE")])
    os.kill(directory["pid"], signal.SIGKILL)
    killed, handle = time.monotonic(), ray.get_actor(DIRECTORY)
    for _ in range(200):  # until Ray has restarted it
        try:
            ray.get(handle.lookup.remote("default", "alice", "durable"), timeout=5)
            break
        except ray.exceptions.RayError:
            time.sleep(0.1)
    print(f"the directory answered again {time.monotonic() - killed:.1f} s after its SIGKILL")
    (restarted,) = list_actors(ray_cluster.address, filters=[("name", "=", DIRECTORY), ("state", "=", "ALIVE")])
    assert restarted["pid"] != directory["pid"]

    assert run("open", second) == saved  # recomputed on the other node from the lineage read back
    collision = run("save", second, text="x")
    assert collision[1] == "error" and "already exists" in collision[2], collision
    assert json.loads(run("delete", second)[2]) == {"deleted": "durable"}
    assert run("open", head)[1:] == ["return", "null"]


WAITS_WITH_A_WALLET = """
from inferlet import Context, Model, Sampler, session

async def main(input):
    ctx = Context(Model.load("default"))
    ctx.user("hold a page or two").cue()
    await ctx.flush()
    session.send("holding")
    await session.receive()
    return await ctx.generate(Sampler.argmax(), max_tokens=4, stop=[]).collect_tokens()
"""


def test_the_market_restarts_with_its_wallets_and_running_instances_finish(cluster, launcher, ray_cluster):
    """SIGKILL the market while an instance holds its wallet: Ray restarts it with the wallets it saved, the
    instance finishes (its wallet closes on the restarted market), a new launch joins it, and the books balance."""
    import os
    import signal

    from pie_cluster.hosts.driver_events import poll
    from pie_cluster.market import MARKET_NAME, MarketSummary
    from ray.util.state import list_actors

    def holding(instance: str) -> None:
        since, kinds = 0, []
        while "message" not in kinds:
            got = poll(launcher, "alice", instance, since, 5.0)
            since, kinds = got.next_index, [e[1] for e in got.events]

    def finish(instance: str) -> list:
        host = ray.get(launcher.locate.remote("alice", instance)).host
        ray.get(host.send.remote("alice", instance, "message", "finish"))
        return run_to_end(launcher, instance)[-1]

    def market() -> MarketSummary:
        return ray.get(cluster.status.remote()).market

    program = upload(launcher, WAITS_WITH_A_WALLET)
    first = launch(launcher, program)
    holding(first)
    assert market().wallets == 1
    time.sleep(0.5)  # past the market's save interval
    (actor,) = list_actors(ray_cluster.address, filters=[("name", "=", MARKET_NAME), ("state", "=", "ALIVE")])
    os.kill(actor["pid"], signal.SIGKILL)
    killed = time.monotonic()
    restored = ray.get(ray.get_actor(MARKET_NAME).summary.remote(), timeout=60)  # sent again once it restarted
    print(f"the market answered again {time.monotonic() - killed:.1f} s after its SIGKILL")
    assert restored.restored and restored.wallets == 1 and restored.balanced, restored

    assert finish(first)[1] == "return"
    second = launch(launcher, program)
    holding(second)
    assert market().wallets == 1  # the first one's closed, the second one's opened, on the restarted market
    assert finish(second)[1] == "return"
    after = market()
    assert after.wallets == 0 and after.balanced, after


def test_the_launcher_restarts_knowing_its_programs_and_the_instances_running(
    cluster, launcher, ray_cluster, store_parent
):
    """SIGKILL the launcher while an instance runs, and take its program files away as if it were restarted on
    another node: Ray restarts it, it reads its programs back from the GCS and asks the hosts what runs, so the
    instance is listed (its launch as before) and followed as before and finishes, and programs uploaded before
    launch."""
    import os
    import shutil
    import signal

    from pie_cluster.hosts.driver_events import poll
    from ray.util.state import list_actors

    program = upload(launcher, WAITS_WITH_A_WALLET)
    first = launch(launcher, program)
    (before,) = [i for i in ray.get(launcher.list.remote("alice")) if i.id == first]
    since, kinds = 0, []
    while "message" not in kinds:
        got = poll(launcher, "alice", first, since, 5.0)
        since, kinds = got.next_index, [e[1] for e in got.events]
    (actor,) = list_actors(ray_cluster.address, filters=[("name", "=", "pie-launcher"), ("state", "=", "ALIVE")])
    os.kill(actor["pid"], signal.SIGKILL)
    killed = time.monotonic()
    for store in store_parent.iterdir():  # the restart's disk has none of the program files
        shutil.rmtree(store)
    while True:
        try:
            listed = ray.get(launcher.list.remote("alice"), timeout=5)
            if any(i.id == first for i in listed):
                break
        except ray.exceptions.RayError:
            pass
        assert time.monotonic() - killed < 60, "the launcher did not come back within 60 s"
        time.sleep(0.2)
    print(f"the launcher listed the running instance again {time.monotonic() - killed:.1f} s after its SIGKILL")
    (again,) = [i for i in listed if i.id == first]
    assert again.status == "running" and again.program.startswith("prog@"), again
    assert (again.created, again.input) == (before.created, before.input)  # its launch, as its host kept it

    host = ray.get(launcher.locate.remote("alice", first)).host
    ray.get(host.send.remote("alice", first, "message", "finish"))
    assert run_to_end(launcher, first)[-1][1] == "return"  # its ending reached the restarted launcher
    second = launch(launcher, program)  # uploaded before the restart
    host = ray.get(launcher.locate.remote("alice", second, 30.0)).host
    ray.get(host.send.remote("alice", second, "message", "finish"))
    assert run_to_end(launcher, second)[-1][1] == "return"
    for _ in range(100):  # the hosts report endings to the launcher a moment after their clients see them
        if ray.get(launcher.stats.remote()).running == 0:
            break
        time.sleep(0.1)
    assert ray.get(launcher.stats.remote()).running == 0  # no admission slot leaked across the restart


WAITS = """
from inferlet import session

async def main(input):
    return await session.receive()
"""


def test_a_restarted_launcher_lists_what_ended_and_queues_again_what_waited(cluster, launcher, ray_cluster):
    """SIGKILL the launcher with one of erin's instances finished, her 10 slots running and two launches waiting,
    and end one of hers while it is down: the restart lists the finished one and the one that ended meanwhile (their
    hosts keep their endings), gives that one's slot to the older waiting launch, and starts the other when the
    next slot frees."""
    import os
    import signal

    from ray.util.state import list_actors

    user = "erin"
    program = upload(launcher, WAITS, user=user)

    def send(instance: str, text: str) -> None:
        host = ray.get(launcher.locate.remote(user, instance, 30.0)).host
        ray.get(host.send.remote(user, instance, "message", text))

    def statuses() -> dict[str, str]:
        return {i.id: i.status for i in ray.get(launcher.list.remote(user), timeout=5)}

    def ending(instance: str) -> list:
        return run_to_end(launcher, instance, user)[-1][1:]

    done = launch(launcher, program, user=user)
    send(done, "done")
    assert ending(done) == ["return", "done"]
    running = [launch(launcher, program, user=user) for _ in range(LAUNCHER_LIMITS["max_running_per_user"])]
    hosts = {i: ray.get(launcher.locate.remote(user, i, 30.0)).host for i in running}
    waiting = [launch(launcher, program, user=user) for _ in range(2)]
    assert [statuses()[i] for i in waiting] == ["queued", "queued"]

    (actor,) = list_actors(ray_cluster.address, filters=[("name", "=", "pie-launcher"), ("state", "=", "ALIVE")])
    os.kill(actor["pid"], signal.SIGKILL)
    ended_meanwhile = running.pop(0)
    ray.get(hosts[ended_meanwhile].send.remote(user, ended_meanwhile, "message", "meanwhile"))
    killed, listed = time.monotonic(), {}
    while True:
        try:
            listed = statuses()
            if waiting[0] in listed and listed[waiting[0]] == "running":
                break
        except ray.exceptions.RayError:
            pass
        assert time.monotonic() - killed < 60, f"the launcher did not start the waiting launch within 60 s: {listed}"
        time.sleep(0.2)
    print(f"the restarted launcher started a waiting launch {time.monotonic() - killed:.1f} s after its SIGKILL")
    assert listed[done] == "finished" and listed[ended_meanwhile] == "finished"
    assert ending(ended_meanwhile) == ["return", "meanwhile"]
    assert [listed[i] for i in running] == ["running"] * len(running) and listed[waiting[1]] == "queued"

    for instance in [*running, waiting[0]]:
        send(instance, "bye")
    send(waiting[1], "last")  # waits for a slot first
    assert ending(waiting[1]) == ["return", "last"]
    assert all(ending(i) == ["return", "bye"] for i in [*running, waiting[0]])
    for _ in range(100):  # the hosts report endings to the launcher a moment after their clients see them
        stats = ray.get(launcher.stats.remote())
        if stats.running == stats.queued == 0:
            break
        time.sleep(0.1)
    assert stats.running == stats.queued == 0, stats


def test_a_snapshot_saved_on_one_node_opens_takes_and_deletes_from_the_other(cluster, launcher):
    head, second = node_pair(cluster)
    program, name = upload(launcher, SNAPSHOTS), "handbook"

    def outcome(op: str, node: str, **input) -> list:
        return run_to_end(launcher, launch(launcher, program, {"op": op, "name": name, **input}, node_id=node))[-1]

    def run(op: str, node: str, **input):
        last = outcome(op, node, **input)
        assert last[1] == "return", last
        return json.loads(last[2])

    saved = run("save", head, text="Pages are sixteen tokens long. ")
    assert saved["seq_len"] > 16
    here, there = run("open", head), run("open", second)  # recomputed on the second node from the lineage
    assert here == there == saved, "the same KV, so the same greedy continuation, wherever it is opened"
    collision = outcome("save", second, text="x")  # the name is taken cluster-wide
    assert collision[1] == "error" and "already exists" in collision[2]

    assert run("take", second) == saved  # moved: gone from the directory and from the head's pool
    assert run("open", head) is None and run("open", second) is None
    assert run("save", second, text="Pages are sixteen tokens long. ") == saved
    assert run("delete", head) == {"deleted": name}  # deleted from the other node: the second node's pages are freed
    assert run("open", second) is None

    # a take racing an open on the other node: the directory orders them; the take always gets the snapshot, the
    # open gets it (recomputed) if it came first, else nothing; either way the name is gone afterwards
    assert run("save", head, text="Pages are sixteen tokens long. ") == saved
    taking = launch(launcher, program, {"op": "take", "name": name}, node_id=head)
    opening = launch(launcher, program, {"op": "open", "name": name}, node_id=second)
    took, opened = (json.loads(run_to_end(launcher, i)[-1][2]) for i in (taking, opening))
    assert took == saved and opened in (saved, None)
    assert run("open", head) is None and run("open", second) is None
    for replica in engine_stats(cluster):
        assert replica.contexts == 0 and replica.pages_used == 0, replica


ADAPTERS = """
import array
from inferlet import Adapter, Context, Logits, Model

async def perturbed(model, adapter):
    \"\"\"The next-token logits under the adapter, perturbed by zo seed 5 (so its random A matters).\"\"\"
    with Context(model) as ctx:
        fwd = ctx.forward().input([5, 6, 7, 8]).adapter(adapter)
        fwd.zo_seed(5)
        handle = fwd.probe(3, Logits())
        logits = array.array("f", (await fwd.execute()).logits(handle))
        return [round(x, 4) for x in logits[:64]]

async def main(input):
    model, op, name = Model.load("default"), input["op"], input["name"]
    try:
        if op == "create":
            adapter = Adapter.create(model, name, rank=4)
        elif op == "open":
            adapter = Adapter.open(model, name)
            if adapter is None:
                return None
        elif op == "load":
            adapter = Adapter.create(model, input["into"], rank=2)
            adapter.load(input["path"])
        elif op == "reload":
            adapter = Adapter.open(model, name)
            adapter.load(input["path"])
        if input.get("save"):
            adapter.save(input["save"])
        logits = await perturbed(model, adapter)
        if input.get("destroy"):
            adapter.destroy()
        return {"logits": logits, "rank": adapter.rank}
    except ValueError as e:
        return {"error": str(e)}
"""


def test_an_adapter_made_on_one_node_is_the_same_on_the_other(cluster, launcher):
    head, second = node_pair(cluster)
    program = upload(launcher, ADAPTERS)

    def run(node: str, **input):
        last = run_to_end(launcher, launch(launcher, program, input, node_id=node))[-1]
        assert last[1] == "return", last
        return json.loads(last[2])

    made = run(head, op="create", name="shared", save="kept/shared")
    assert made["rank"] == 4
    assert run(second, op="open", name="shared") == made, "a copy of the same weights: the same perturbed logits"
    assert run(second, op="load", name="x", into="loaded", path="kept/shared") == made, "saved on the head's disk"
    assert "already exists" in run(second, op="create", name="shared")["error"]
    other = run(head, op="create", name="other", save="kept/other")
    assert other["logits"] != made["logits"], "the adapter's weights decide the logits (so equal ones say something)"
    assert run(head, op="reload", name="shared", path="kept/other") == other
    assert run(second, op="open", name="shared") == other, "new weights loaded on the head reached the copy here"
    assert run(second, op="open", name="shared", destroy=True) == other
    assert run(head, op="open", name="shared") is None, "destroyed on the second node: gone on the head too"
    assert run(head, op="create", name="shared")["rank"] == 4, "the name is free again"


def test_a_placement_ray_could_never_satisfy_is_refused_before_anything_starts(cluster):
    config = PieConfig(auth=AuthConfig(enabled=False), model=[ModelConfigEntry(replicas=3, placement="strict_spread")])
    controller = ray.remote(Controller).options(name="pie-controller-unplaceable", num_cpus=0).remote(config)
    with pytest.raises(Exception, match="'strict_spread' needs a node per replica, but 3 replicas were asked of 2"):
        ray.get(controller.ready.remote())


PING = """
from inferlet import messaging

async def main(input):
    me, other, rounds = input["me"], input["other"], input["rounds"]
    seen = []
    for i in range(rounds):
        if me == "ping":
            messaging.push(f"to-{other}", f"{me}-{i}")
            seen.append(await messaging.pull(f"to-{me}"))
        else:
            seen.append(await messaging.pull(f"to-{me}"))
            messaging.push(f"to-{other}", f"{me}-{i}")
    return seen
"""

SWARM = """
import asyncio
from inferlet import messaging

async def main(input):
    me, n = input["me"], input["n"]
    sub = messaging.subscribe("swarm")
    messaging.push("ready", me)
    await messaging.pull(f"go-{me}")
    for i in range(input["per"]):
        messaging.broadcast("swarm", f"{me}:{i}")
    got = []
    async for msg in sub:
        got.append(msg)
        if len(got) == n * input["per"]:
            break
    sub.unsubscribe()
    return got
"""


def test_inferlets_on_different_nodes_play_ping_pong_and_swarm_over_the_bus(cluster, launcher):
    import json

    nodes = ray.get(cluster.nodes.remote())
    assert len(nodes) == 2
    program = upload(launcher, PING)
    rounds = 50
    ping = launch(launcher, program, {"me": "ping", "other": "pong", "rounds": rounds}, node_id=nodes[0])
    pong = launch(launcher, program, {"me": "pong", "other": "ping", "rounds": rounds}, node_id=nodes[1])
    assert json.loads(run_to_end(launcher, ping)[-1][2]) == [f"pong-{i}" for i in range(rounds)]
    assert json.loads(run_to_end(launcher, pong)[-1][2]) == [f"ping-{i}" for i in range(rounds)]

    swarm, n, per = upload(launcher, SWARM, user="bob"), 8, 5
    ids = [
        launch(launcher, swarm, {"me": f"m{i}", "n": n, "per": per}, user="bob", node_id=nodes[i % 2]) for i in range(n)
    ]
    gate = upload(launcher, GATE, user="bob")
    launch(launcher, gate, {"n": n}, user="bob")  # releases the swarm once all have subscribed
    results = [json.loads(run_to_end(launcher, i, "bob")[-1][2]) for i in ids]
    everything = sorted(f"m{i}:{j}" for i in range(n) for j in range(per))
    for got in results:
        assert sorted(got) == everything  # each message exactly once, to every subscriber
        for i in range(n):  # and each sender's messages in the order sent
            mine = [m for m in got if m.startswith(f"m{i}:")]
            assert mine == [f"m{i}:{j}" for j in range(per)]


GATE = """
from inferlet import messaging

async def main(input):
    ready = [await messaging.pull("ready") for _ in range(input["n"])]
    for who in ready:
        messaging.push(f"go-{who}", "go")
    return sorted(ready)
"""


SUBSCRIBED_GREEDY = """
from inferlet import Context, Model, Sampler, messaging, session

async def main(input):
    messaging.subscribe("news")  # a bus session too, released when it ends
    model = Model.load("default")
    with Context(model) as ctx:
        ctx.user(input["prompt"])
        tokens = await ctx.generate(Sampler.argmax(), max_tokens=16, stop=[]).collect_tokens()
        session.send("half way")
        await session.receive()
        tokens += await ctx.generate(Sampler.argmax(), max_tokens=input["n"] - 16, stop=[]).collect_tokens()
    return {"tokens": tokens, "moves": model.link.moves}
"""


def test_a_replica_killed_mid_generation_is_replaced_and_its_inferlets_move_to_another(
    cluster, launcher, served, ray_cluster
):
    """SIGKILL the head's replica while an inferlet on each node generates: the head's moves to the second node's
    replica and finishes with the tokens the second node's makes from the same prompt, the controller replaces the
    replica, a new launch on the head works, and the market's books, the bus and the replicas' pages balance
    afterwards."""
    import os
    import signal

    from pie_cluster.hosts.driver_events import poll
    from ray.util.state import list_actors

    head, second = node_pair(cluster)
    program, bounded = upload(launcher, SUBSCRIBED_GREEDY), upload(launcher, GREEDY)
    bus_before = ray.get(cluster.status.remote()).bus
    doomed = launch(launcher, program, {"prompt": "keep going", "n": 200}, node_id=head)
    survivor = launch(launcher, program, {"prompt": "keep going", "n": 200}, node_id=second)
    for instance in (doomed, survivor):  # both half way, waiting
        since, kinds = 0, []
        while "message" not in kinds:
            got = poll(launcher, "alice", instance, since, 5.0)
            since, kinds = got.next_index, [e[1] for e in got.events]
    served_leader = served.replica.leader._actor_id.hex()
    (rank,) = [
        a
        for a in list_actors(
            ray_cluster.address, filters=[("class_name", "=", "RankWorker"), ("state", "=", "ALIVE")], detail=True
        )
        if a["node_id"] == head and a["actor_id"] != served_leader and a["ray_namespace"] == "pie-test"
    ]
    os.kill(rank["pid"], signal.SIGKILL)
    for instance in (doomed, survivor):
        host = ray.get(launcher.locate.remote("alice", instance)).host
        ray.get(host.send.remote("alice", instance, "message", "go on"))

    moved = run_to_end(launcher, doomed)[-1]
    finished = run_to_end(launcher, survivor)[-1]
    assert moved[1] == "return" and finished[1] == "return", (moved, finished)
    moved, finished = json.loads(moved[2]), json.loads(finished[2])
    assert (moved["moves"], finished["moves"]) == (1, 0)
    assert moved["tokens"] == finished["tokens"] and len(moved["tokens"]) == 200
    for _ in range(240):
        status = ray.get(cluster.status.remote())
        if status.replica_restarts >= 1 and all(r.state == "serving" for r in status.replicas):
            break
        time.sleep(0.5)
    assert all(r.state == "serving" for r in status.replicas), status.replicas
    again = run_to_end(launcher, launch(launcher, bounded, {"prompt": "back again", "n": 4}, node_id=head))[-1]
    assert again[1] == "return", again

    status = ray.get(cluster.status.remote())
    for replica in status.replicas:
        assert replica.contexts == 0 and replica.pages_used == 0, replica
    assert status.bus.subscriptions == bus_before.subscriptions
    assert status.market.wallets == 0 and status.market.balanced


@ray.remote(num_cpus=0)
class IngressStandIn:
    """Stands for an ingress replica: the launcher pings the actor of a runner holding a lease, to learn it died."""


def test_leased_slots_come_from_the_same_counts_and_queue_as_launches_and_end_with_their_replica(cluster, launcher):
    """Two ingress replicas lease carol's slots (her limit: 10): the first gets six, the second four and two places
    in the queue, and her uploaded launch waits behind those, in order. A slot the first gives back goes to the
    second's oldest ask; idle slots are asked back while launches wait; the second replica's death ends its lease,
    which frees its slots and queue places for her launch. A node with no view of the models is told to run on a
    host, and past the queue's limits an ask is refused as ``Overloaded`` is."""
    from pie_cluster.launcher.records import Granted, Queued, Refused, RunnerReport, RunOnHost, SlotAsk

    user, limit = "carol", LAUNCHER_LIMITS["max_running_per_user"]
    node = ray.get(cluster.nodes.remote())[0]
    first, second = IngressStandIn.remote(), IngressStandIn.remote()

    def lease(name: str, handle, count: int, on: str = node) -> list:
        asks = [SlotAsk(f"{name}-{i}", user) for i in range(count)]
        return ray.get(launcher.lease.remote(on, name, handle, asks))

    assert lease("first", first, 6) == [Granted()] * 6
    assert lease("second", second, 6) == [Granted()] * 4 + [Queued()] * 2
    assert ray.get(launcher.stats.remote()).running >= limit
    program = upload(launcher, "async def main(input):\n    return 'ran'\n", user=user)
    waiting = launch(launcher, program, user=user)
    assert {i.id: i.status for i in ray.get(launcher.list.remote(user))}[waiting] == "queued"
    assert not ray.get(launcher.slot.remote("second", "second-4", 0.2))  # still waiting

    ray.get(launcher.report.remote(RunnerReport("first", node, first, returned={user: 1}, held={user: 5})))
    assert ray.get(launcher.slot.remote("second", "second-4", 5.0))  # the oldest ask got the slot given back
    assert not ray.get(launcher.slot.remote("second", "second-5", 0.2))  # the next one still waits
    assert ray.get(launcher.orders.remote("first", 0.1)).reclaim is False  # it reported nothing idle
    ray.get(launcher.report.remote(RunnerReport("first", node, first, held={user: 5}, idle={user: 2})))
    assert ray.get(launcher.orders.remote("first", 5.0)).reclaim  # launches wait: its idle slots are asked back

    ray.kill(second)  # its lease ends with it: five slots and a place in the queue
    deadline = time.time() + 60
    while time.time() < deadline:
        status = {i.id: i for i in ray.get(launcher.list.remote(user))}[waiting].status
        if status != "queued":
            break
        time.sleep(0.2)
    assert run_to_end(launcher, waiting, user)[-1][1:] == ["return", "ran"]

    assert lease("first", first, 1, on="no-such-node") == [RunOnHost()]
    crowd = lease("first", first, limit + LAUNCHER_LIMITS.get("max_queued_per_user", 1024) + 1)
    assert isinstance(crowd[-1], Refused) and crowd[-1].retry_after_s is not None and user in crowd[-1].message
    held = sum(isinstance(answer, Granted) for answer in crowd) + 5
    queued = [f"first-{i}" for i, answer in enumerate(crowd) if isinstance(answer, Queued)]
    for ask_id in queued:
        ray.get(launcher.withdraw.remote("first", ask_id))
    ray.get(launcher.report.remote(RunnerReport("first", node, first, returned={user: held})))
    stats = ray.get(launcher.stats.remote())
    assert stats.queued == 0
    ray.kill(first)
