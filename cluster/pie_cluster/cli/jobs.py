"""``pie submit --jobs``: run an inferlet as a Ray job through the Jobs API, for batch work — an operator's tool.

The job's entrypoint is ``pie job-run``, which joins the cluster as a Ray driver, hands the program to the launcher
directly (no HTTP, no bearer token: whoever may submit Ray jobs is trusted, and names the user), follows the
instance's events into the job's log, and exits with the instance's outcome. The program's directory travels as
the job's ``working_dir``. The inferlet itself runs where any launch runs (in the sandbox); the job does not: the
Jobs API runs any command with the cluster's full access, so only holders of Ray's cluster token may use it.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import time
from contextlib import aclosing
from pathlib import Path

import ray
from pie_workers.deadlines import LAUNCHER_S, answered
from rich.console import Console

from pie_cluster.cli.state import load_state
from pie_cluster.client import package
from pie_cluster.hosts.events import follow
from pie_cluster.launch_request import LaunchRequest
from pie_cluster.ray_session import NAMESPACE

err = Console(stderr=True)


def submit_job(program: Path, request: LaunchRequest, dashboard: str | None, user: str | None, python: str) -> int:
    """Submit, stream the job's log, and return 0 if the inferlet returned (1 otherwise). ``request.program`` is
    ignored: the job uploads ``program`` and launches it with the rest of ``request``."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    dashboard = dashboard or os.environ.get("RAY_DASHBOARD_ADDRESS") or load_state().get("dashboard")
    if not dashboard:
        err.print("[red]error:[/red] no Ray dashboard address: pass --dashboard or run `pie start` first")
        return 1
    program = program.resolve()
    working_dir, target = (program, ".") if program.is_dir() else (program.parent, program.name)
    request = request.model_copy(update={"program": target})
    args = [python, "-m", "pie_cluster.cli.app", "job-run", request.model_dump_json(exclude_none=True)]
    args += ["--user", user or os.environ.get("USER", "local")]
    client = JobSubmissionClient(dashboard if "://" in dashboard else f"http://{dashboard}")
    deadline_s = time.monotonic() + 180
    while True:  # a freshly started cluster's job agent may not be up yet ("No available agent ... try again")
        try:
            job = client.submit_job(entrypoint=shlex.join(args), runtime_env={"working_dir": str(working_dir)})
            break
        except RuntimeError as e:
            if "No available agent" not in str(e) or time.monotonic() > deadline_s:
                raise
            time.sleep(1.0)
    err.print(f"submitted Ray job {job}")

    async def tail() -> None:
        async for chunk in client.tail_job_logs(job):
            print(chunk, end="", flush=True)

    asyncio.run(tail())
    while (status := client.get_job_status(job)) not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
        time.sleep(0.2)
    return 0 if status == JobStatus.SUCCEEDED else 1


def job_run(request: LaunchRequest, user: str) -> int:
    """Inside the Ray job: upload ``request.program`` (a path in the job's working directory), launch it through
    the launcher actor and print events as ``pie submit`` would."""
    filename, data = package(request.program)  # read before joining Ray: the job starts in its working_dir
    ray.init(address="auto", namespace=NAMESPACE, log_to_driver=False)
    try:
        launcher = ray.get_actor("pie-launcher")
    except ValueError:
        err.print("[red]error:[/red] no Pie cluster is running on this Ray cluster (run `pie start`)")
        return 1
    program_id = answered(launcher.upload.remote(user, filename, data), "the launcher", LAUNCHER_S).program
    launched = launcher.launch.remote(user, request.model_copy(update={"program": program_id}))
    instance = answered(launched, "the launcher", LAUNCHER_S)
    return asyncio.run(_print_events(launcher, user, instance))


async def _print_events(launcher, user: str, instance: str) -> int:
    """Print the instance's events into the job's log; 0 if it returned, 1 if it failed."""
    tag = f"[Instance {instance[:8]}]"
    async with aclosing(follow(launcher, user, instance, wait=10.0)) as batches:
        async for events in batches:
            for _, kind, value in events:
                if kind == "return":
                    print(value, flush=True)
                    return 0
                if kind == "error":
                    print(f"{tag} Error: {value}", flush=True)
                    return 1
                text = f"<{len(value)} bytes>" if kind == "file" else value
                print(f"{tag} {kind}: {text}".rstrip("\n"), flush=True)
    return 1
