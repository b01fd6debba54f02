"""Ray's GCS killed and started again, with its tables in an external Redis (GCS fault tolerance, as the Helm chart
and the `ray up` configs set it up): the Pie cluster serves again with what it had. The cluster runs in a process
and Ray cluster of its own (``gcs_outage.py``), since this session's Ray has no Redis behind it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from support.paths import SUPPORT

SCRIPT = SUPPORT / "gcs_outage.py"


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server binary (`make` installs one)")
def test_the_cluster_serves_again_after_the_gcs_restarts_with_its_instances_snapshots_and_wallets():
    env = {**os.environ, "RAY_ADDRESS": ""}
    run = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600, env=env, cwd=SCRIPT.parent
    )
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"a launch ran to its end {seen['serving_again_s']} s after the GCS was back")

    expected = seen["expected"]
    assert seen["fresh"][1:] == ["return", json.dumps(expected)], seen  # the program uploaded before is launchable
    assert seen["waited"][1:] == ["return", json.dumps(expected)], seen  # the instance running across it finished
    assert seen["reopened"][1:] == ["return", json.dumps(expected)], seen  # the snapshot saved before opens
    assert seen["waiting_id"] in seen["listed"], seen
    for ending in seen["load"]:  # generating and messaging all through the outage, every round as before it
        assert ending[1] == "return", ending
        rounds, differed = json.loads(ending[2])
        assert rounds > 0 and differed == 0, ending
    print(f"instances under load through the outage ran {[json.loads(e[2])[0] for e in seen['load']]} rounds")
    assert seen["market_before"]["wallets"] == 1 and seen["market_after"]["balanced"], seen
    assert seen["replicas"] == ["serving"], seen
