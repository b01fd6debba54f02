"""Replicas and nodes that follow a load ramp on Ray's own autoscaler (``ray.cluster_utils.AutoscalingCluster``,
its fake node provider starting and stopping raylets on this machine): ``bench/elastic.py --smoke`` in a process of
its own (it starts a Ray cluster of its own), whose per-second samples and requests this test reads.

The head has no room for a replica, so the model's first replica waits for a node the autoscaler adds; the load's
peak wants a second replica, whose pending placement group makes the autoscaler add a second node; once the load
is gone the replica is removed, its node gives its inferlet host back (``control.node_release``) and the autoscaler
removes the idle node, but only once an inferlet that ran there has ended (its context, on the removed replica,
moved to the other with its KV). Every request of the ramp is answered, through the changes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support.paths import ROOT


@pytest.mark.slow
@pytest.mark.alone
def test_replicas_and_nodes_follow_a_load_ramp_on_rays_autoscaler(tmp_path):
    out = tmp_path / "runs.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # not the test session's cluster
    done = subprocess.run(
        [sys.executable, "elastic.py", "--smoke", "--json", str(out), "--out", ""],
        cwd=ROOT / "bench", env=env, capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run,) = json.loads(out.read_text())
    samples, requests = run["samples"], run["requests"]

    assert requests and not [r["error"] for r in requests if r["error"]]
    assert all(r["ttft_s"] is not None for r in requests)  # every request streamed its first token
    assert (samples[0]["replicas"], samples[0]["nodes"]) == (1, 1)  # the first replica on the one node added
    peak = [s for s in samples if s["replicas"] == 2]
    assert peak, samples  # the load's peak got a second replica ...
    assert max(s["nodes"] for s in samples) == 2  # ... on a second node the autoscaler added for it
    first_two_nodes = next(s["t"] for s in samples if s["nodes"] == 2)
    assert first_two_nodes <= peak[0]["t"]  # the node came for the replica, not after it
    assert run["settled_s"] is not None, samples[-5:]  # back to 1 replica on 1 node once the load was gone
    assert len(run["released"]) == 1  # `pie status` said why the node could go: its host given back
    pinned = run["pinned"]  # an inferlet on the added node, holding a context on its replica through the scale-down
    assert pinned is not None and pinned["kept_node"]  # the node stayed while it ran: not released, not removed
    assert (pinned["result"]["moves"], pinned["result"]["transferred"]) == (1, 1)  # its context moved with its KV
    assert pinned["result"]["tokens"] == pinned["unmoved"]["tokens"]  # ... and went on as if it had not moved
