"""A Pie cluster through a restart of Ray's GCS, in a process (and Ray cluster) of its own: run by
``test_gcs_fault_tolerance.py``, which checks the JSON it prints last.

The GCS keeps its tables in a Redis server started here (Ray's GCS fault tolerance: ``RAY_REDIS_ADDRESS``), so a
GCS that is killed and started again finds the cluster's actors, names and placement groups where it left them.
Before the kill: a program is uploaded, one instance saves a snapshot and waits half way through its generation,
the market holds its wallet, and ``LOAD`` instances start generating and messaging in rounds until after the GCS is
back. The GCS is then down for ``OUTAGE_S``; once it is back, the script measures how
long until a new launch runs to its end, lets the waiting instance finish, and opens the snapshot from a new one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUTAGE_S = 5.0
LOAD = 4  # instances generating and messaging through the outage

BUSY = """
import time
from inferlet import Context, Model, Sampler, messaging

async def main(input):
    model, rounds, differed = Model.load("default"), 0, 0
    until = time.monotonic() + input["seconds"]
    while time.monotonic() < until:
        with Context(model) as ctx:
            ctx.user("what outlives a failure?").cue()  # the prompt of SAVES_AND_WAITS
            tokens = await ctx.generate(Sampler.argmax(), max_tokens=4, stop=[]).collect_tokens()
        differed += tokens != input["expected"][:4]
        messaging.push(input["topic"], str(rounds))
        rounds += int(await messaging.pull(input["topic"]) == str(rounds))
    return [rounds, differed]
"""


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: ``support`` as the tests import it
    from support.pie_procs import free_port, own_node

    port, data = free_port(), tempfile.mkdtemp(prefix="pie-redis-")
    redis = subprocess.Popen(
        ["redis-server", "--port", str(port), "--dir", data, "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    os.environ["RAY_REDIS_ADDRESS"] = f"127.0.0.1:{port}"
    os.environ["RAY_external_storage_namespace"] = "pie-gcs-outage"  # noqa: SIM112 (Ray reads this spelling)
    import ray
    from pie_cluster.config import AuthConfig, ModelConfigEntry, PieConfig
    from pie_cluster.control.lifecycle import start_controller
    from pie_cluster.hosts.driver_events import poll
    from ray.cluster_utils import Cluster
    from support.launching import SAVES_AND_WAITS, launch, run_to_end, upload

    alone = {**own_node(), "temp_dir": tempfile.mkdtemp(prefix="ray-gcs-")}  # not the test session's Ray directory
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False, **alone})
    try:
        ray.init(address=cluster.address, namespace="pie-gcs", log_to_driver=False)
        config = PieConfig(auth=AuthConfig(enabled=False), model=[ModelConfigEntry(pages=128, cpus_per_rank=1)])
        controller = start_controller(config, detached=False)
        launcher = ray.get_actor("pie-launcher")
        program = upload(launcher, SAVES_AND_WAITS)
        expected = json.loads(run_to_end(launcher, launch(launcher, program))[-1][2])
        waiting = launch(launcher, program, {"save": True})
        since, seen = 0, []
        while "message" not in seen:  # it saved the snapshot and waits
            got = poll(launcher, "alice", waiting, since, 5.0)
            since, seen = got.next_index, [e[1] for e in got.events]
        host = ray.get(launcher.locate.remote("alice", waiting)).host
        market = ray.get(controller.status.remote()).market
        busy, load = upload(launcher, BUSY), []
        for i in range(LOAD):  # they run from before the kill until after the GCS is back
            work = {"seconds": OUTAGE_S + 4, "expected": expected, "topic": f"load-{i}"}
            load.append(launch(launcher, busy, work))
        time.sleep(1.0)

        cluster.head_node.kill_gcs_server()
        time.sleep(OUTAGE_S)
        cluster.head_node.start_gcs_server()
        back = time.monotonic()
        while True:  # until a new launch runs to its end again
            try:
                fresh = run_to_end(launcher, launch(launcher, program), timeout=30)[-1]
                break
            except Exception as e:  # the GCS's clients are still reconnecting
                if time.monotonic() - back > 120:
                    raise AssertionError(f"no launch ran within 120 s of the GCS's restart: {e}") from e
                time.sleep(0.5)
        serving_again_s = time.monotonic() - back
        ray.get(host.send.remote("alice", waiting, "message", "go on"))
        waited = run_to_end(launcher, waiting)[-1]
        reopened = run_to_end(launcher, launch(launcher, program, {"open": True}))[-1]
        loaded = [run_to_end(launcher, instance)[-1] for instance in load]
        status = ray.get(controller.status.remote())
        print(
            json.dumps(
                {
                    "expected": expected,
                    "fresh": fresh,
                    "waited": waited,
                    "reopened": reopened,
                    "load": loaded,
                    "serving_again_s": round(serving_again_s, 2),
                    "listed": sorted(i.id for i in ray.get(launcher.list.remote("alice"))),
                    "waiting_id": waiting,
                    "market_before": dataclasses.asdict(market),
                    "market_after": dataclasses.asdict(status.market),
                    "replicas": [r.state for r in status.replicas],
                }
            )
        )
        ray.get(controller.shutdown.remote())
    finally:
        ray.shutdown()
        cluster.shutdown()
        redis.kill()


if __name__ == "__main__":
    main()
