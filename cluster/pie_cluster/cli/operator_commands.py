"""``pie start / stop / status / drain / job-run``: bringing Pie's services up on a Ray cluster and looking at them.

``pie start`` joins the Ray cluster at ``--address`` (or the one running on this machine, or starts a local head
with ``ray start --head`` when there is none), creates the detached controller (replicas, bus, hosts, launcher)
in the ``pie`` namespace, deploys the HTTP endpoint on Ray Serve, and records where it all is for the other
commands. ``pie stop`` undoes it (and stops the Ray head if ``pie start`` started it).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pie_cluster.cli.state import clear_state, load_state, save_state

if TYPE_CHECKING:
    from pie_cluster.control.status_records import NodeStatus

console = Console()
err = Console(stderr=True)

AddressOption = Annotated[str | None, typer.Option(help="Ray cluster address (default: the one on this machine)")]


def _join(address: str | None, start_if_missing: bool, source: str | None = None) -> tuple[str, str | None, bool]:
    """Connect to Ray; returns (address, dashboard address, whether we started a head for it). A recorded address
    where nothing answers any more (its head was killed) is said so at once instead of retried for minutes; with
    ``start_if_missing`` and no address asked for, a fresh head replaces it."""
    import ray

    from pie_cluster.ray_session import RayUnreachable, answers, init_ray, ray_cli, recorded_address

    recorded, found_in = recorded_address(address)
    replaceable = start_if_missing and address is None and not os.environ.get("RAY_ADDRESS")  # nobody named it
    dead = recorded is not None and not answers(recorded)
    if dead and not replaceable:
        raise RayUnreachable(f"no Ray cluster answers at {recorded} ({source or found_in})")
    if dead:
        err.print(f"the Ray head recorded at {recorded} is gone; starting a fresh one")
    started = False
    try:
        dashboard = None if dead else init_ray(address=address or "auto")
    except ConnectionError as e:
        if not replaceable:
            raise RayUnreachable(f"cannot join Ray at {address or recorded or 'this machine'}: {e}") from None
        dead = True
    if dead:
        subprocess.run([ray_cli(), "start", "--head", "--disable-usage-stats"], check=True, capture_output=True)
        started = True
        dashboard = init_ray(address="auto")
    return ray.get_runtime_context().gcs_address, dashboard, started


def _address_to_join(address: str | None, state: dict) -> tuple[str | None, bool, str | None]:
    """``_join``'s arguments for stop and status: the address asked for, else the one `pie start` recorded."""
    if address is None and state.get("address"):
        return state["address"], False, "where `pie start` recorded it"
    return address, False, None


@contextlib.contextmanager
def _one_line_errors(action: str) -> Iterator[None]:
    """What is expected to go wrong in these commands (Ray unreachable or dying, a failed `ray start`, a service
    that is gone) is printed as one line with exit code 1, never a traceback."""
    from ray.exceptions import RayError

    try:
        yield
    except (ConnectionError, RuntimeError, ValueError, RayError, FileNotFoundError, TimeoutError) as e:
        err.print(f"[red]error:[/red] {action}: {escape(_first_line(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    except subprocess.CalledProcessError as e:
        detail = (e.stderr or b"").decode(errors="replace").strip().splitlines()
        failed = f"`{' '.join(e.cmd[1:])}` failed: {detail[-1] if detail else e.returncode}"
        err.print(f"[red]error:[/red] {action}: {escape(failed)}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


def _first_line(error: BaseException) -> str:
    from ray.exceptions import RayTaskError

    if isinstance(error, RayTaskError) and error.cause is not None:
        error = error.cause
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def start(
    config: Annotated[Path | None, typer.Option(help="config.toml (default: the embedded model, auth on)")] = None,
    address: AddressOption = None,
    host: Annotated[str | None, typer.Option(help="HTTP bind address (overrides [server].host)")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port (overrides [server].port)")] = None,
    no_auth: Annotated[bool, typer.Option("--no-auth", help="accept every caller as user `local`")] = False,
    model: Annotated[
        Path | None, typer.Option(help="serve this Hugging Face directory (in place of the config's [[model]])")
    ] = None,
    model_name: Annotated[
        str | None, typer.Option(help="--model's name in requests (default: its directory's)")
    ] = None,
    tp: Annotated[int | None, typer.Option(min=1, help="--model's tensor-parallel size (default: 1)")] = None,
    replicas: Annotated[int | None, typer.Option(min=1, help="--model's replicas (default: 1)")] = None,
    min_replicas: Annotated[int | None, typer.Option(min=1, help="--model autoscaled from this many replicas")] = None,
    max_replicas: Annotated[int | None, typer.Option(min=1, help="... up to this many")] = None,
) -> None:
    """Start Pie's services on the Ray cluster (or join the ones already running there)."""
    import ray

    from pie_cluster.config import PieConfig
    from pie_cluster.control.lifecycle import start_controller
    from pie_cluster.ingress.app import serve_http, start_proxy

    try:
        cfg = PieConfig.load(config)
        scaled = {"replicas": replicas, "min_replicas": min_replicas, "max_replicas": max_replicas}
        if model is not None:
            cfg = cfg.serving(model, model_name, tensor_parallel=tp, **scaled)
        elif any(v is not None for v in (model_name, tp, *scaled.values())):
            raise ValueError(
                "--model-name, --tp, --replicas, --min-replicas and --max-replicas describe --model: name the "
                "directory with --model"
            )
        if no_auth:
            cfg.auth.enabled = False
        cfg.check_auth()
    except ValueError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(2) from None
    exposed = cfg.exposed_tokens(config) if config is not None else None
    if exposed is not None:  # a warning, not a refusal: configs written before this check keep starting
        err.print(f"[yellow]warning:[/yellow] {escape(exposed)}", soft_wrap=True)
    if cfg.sandbox.enabled:
        from pie_cluster.hosts.sandbox import SandboxUnavailable
        from pie_cluster.hosts.sandbox.bwrap import probe

        try:
            probe(cfg.sandbox)
        except SandboxUnavailable as e:
            err.print(f"[red]error:[/red] {escape(str(e))}", soft_wrap=True)
            raise typer.Exit(2) from None
    with _one_line_errors("pie start"):
        gcs, dashboard, started = _join(address, start_if_missing=True)
    overrides = {"host": host, "port": port}
    server = cfg.server.model_copy(update={k: v for k, v in overrides.items() if v is not None})
    starting = err.status("starting Pie services (loading models)...")
    with _one_line_errors("pie start"), starting, ThreadPoolExecutor(1, thread_name_prefix="serve") as beside:
        proxy = beside.submit(start_proxy, server)
        start_controller(cfg)
        proxy.result()
        url = serve_http(cfg.auth, ray.get_runtime_context().namespace, server, cfg.responses, cfg.cache)
    token = next(iter(cfg.auth.tokens), None) if cfg.auth.enabled and len(cfg.auth.tokens) == 1 else None
    save_state({"address": gcs, "url": url, "dashboard": dashboard, "started_ray": started, "token": token})
    console.print(f"[green]✓[/green] Pie is up: {url}  (Ray at {gcs})")


def stop(address: AddressOption = None) -> None:
    """Stop Pie's services (and the local Ray head, if `pie start` started it). Works with any part dead: a Ray
    cluster that is gone leaves only Pie's record of it, which is cleared, so the next `pie start` starts clean."""
    from pie_cluster.control.lifecycle import stop_controller
    from pie_cluster.ingress.app import stop_http
    from pie_cluster.ray_session import RayUnreachable, ray_cli

    state = load_state()
    with _one_line_errors("pie stop"):
        try:
            _join(*_address_to_join(address, state))
        except RayUnreachable as gone:
            clear_state()
            console.print(f"{gone}; nothing left to stop (cleared Pie's record of it)", soft_wrap=True)
            return
        with contextlib.suppress(Exception):  # Serve not running, or its controller gone: nothing to undeploy
            stop_http()
        stopped = stop_controller()
        if state.get("started_ray") and address is None:
            subprocess.run([ray_cli(), "stop"], check=False, capture_output=True)
    clear_state()
    console.print("[green]✓[/green] Pie stopped" if stopped else "no Pie services were running")


def status(
    address: AddressOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the raw status as JSON")] = False,
) -> None:
    """Replicas (state, pages used/total, suspended contexts, page price, queue, batches), nodes and their inferlet
    hosts, instances, wallets, bus. A dead or unresponsive part is shown as such."""
    from pie_workers.deadlines import CONTROLLER_S, answered

    from pie_cluster.control.lifecycle import find_controller
    from pie_cluster.control.status_records import Unanswered, status_json

    with _one_line_errors("pie status"):
        _join(*_address_to_join(address, load_state()))
        report = answered(find_controller().status.remote(), "the controller", CONTROLLER_S)
    if as_json:
        print(json.dumps(status_json(report), indent=2))
        return
    table = Table(title="replicas")
    columns = ("model", "#", "node", "TP", "CPUs/rank", "threads", "device", "state", "pages used / total", "cached")
    columns = (*columns, "suspended", "price")
    for column in (*columns, "queued", "batches"):
        table.add_column(column)
    for r in report.replicas:
        head = [r.model, str(r.replica), r.node[:8], str(r.tensor_parallel)]
        head += [str(r.cpus_per_rank), str(r.threads), f"{r.device} ({r.backend}, {r.decode_graphs})", r.state]
        if r.state != "serving":
            table.add_row(*head, *["-"] * 6)
            continue
        table.add_row(
            *head,
            f"{r.pages_used} / {r.pages_total}",
            str(r.pages_cached),
            str(r.suspended),
            f"{r.price:g}",
            str(r.queued),
            str(r.batches),
        )
    console.print(table)
    for scale in report.scaling:
        bounds = f"{scale.min_replicas}-{scale.max_replicas}"
        replicas = f"{scale.current} replicas, target {scale.target} ({bounds})"
        console.print(f"model {scale.model}: {replicas}: {scale.reason}")
    for node in report.nodes:
        if not node.alive or node.host != "serving":
            console.print(f"node {node.node[:8]}: {'alive' if node.alive else 'lost'}, host {node.host}")
    for node in report.drained:
        console.print(f"node {node.node[:8]}: drained{' (still in the cluster)' if node.alive else ''}")
    for node in report.released:
        console.print(f"node {node[:8]}: released (no replica, no inferlet: Ray's autoscaler may remove it)")
    launcher, bus, market = report.launcher, report.bus, report.market
    console.print(
        " · ".join(
            [
                f"nodes {sum(n.alive for n in report.nodes)}/{len(report.nodes)}",
                _sandbox_line(report.nodes),
                f"launcher {launcher.state}"
                if isinstance(launcher, Unanswered)
                else f"instances running {launcher.running} (launched {launcher.launched})",
                f"bus {bus.state}"
                if isinstance(bus, Unanswered)
                else f"bus topics {bus.topics}, subscriptions {bus.subscriptions}",
                f"market {market.state}"
                if isinstance(market, Unanswered)
                else f"wallets {market.wallets} holding {market.held:g} credits",
            ]
        )
    )


def drain(
    node: Annotated[str | None, typer.Argument(help="the node's Ray id, or a prefix of it that names one node")] = None,
    this_node: Annotated[bool, typer.Option("--this-node", help="drain the node this command runs on")] = False,
    timeout: Annotated[float, typer.Option(help="seconds its instances get to finish")] = 300.0,
    address: AddressOption = None,
) -> None:
    """Take a node out of use: no new launches there, its running instances finish (those still running after
    --timeout end with an error saying so), then its inferlet host stops. Its replicas serve until the node leaves
    the cluster; their inferlets then move to the model's other replicas. For a KubeRay pod's preStop hook:
    `pie drain --this-node`."""
    import ray
    from pie_workers.deadlines import answered

    from pie_cluster.control.lifecycle import find_controller

    with _one_line_errors("pie drain"):
        _join(*_address_to_join(address, load_state()))
        if this_node == (node is not None):
            raise ValueError("name one node, or pass --this-node")
        controller = find_controller()
        nodes = answered(controller.nodes.remote(), "the controller", 60)
        wanted = ray.get_runtime_context().get_node_id() if this_node else node
        matches = [n for n in nodes if n.startswith(wanted)]
        if len(matches) != 1:
            raise ValueError(f"{wanted!r} names {len(matches)} of the nodes with an inferlet host: {', '.join(nodes)}")
        report = answered(controller.drain.remote(matches[0], timeout), "the controller", timeout + 120)
    replicas = f"; replicas still there until it leaves: {', '.join(report.replicas)}" if report.replicas else ""
    replicas += "".join(f"; {moved}" for moved in report.moved)
    console.print(
        f"[green]✓[/green] node {report.node[:8]} drained in {report.seconds:g} s: {report.finished} "
        f"instance(s) finished, {report.ended} ended by the timeout{replicas}",
        soft_wrap=True,
    )


def _sandbox_line(nodes: list[NodeStatus]) -> str:
    """How uploaded programs run: ``off`` means trusted users only (their code can reach Ray); with the sandbox on,
    how each worker is bounded as a whole (``cgroup`` or ``rlimit``: see the README's security model)."""
    described = [n.description for n in nodes if n.description is not None]
    modes = sorted({d.sandbox for d in described}) or ["unknown"]
    pools = [d.pool for d in described if d.pool is not None]
    workers = sum(pool.workers for pool in pools)
    limits = "/".join(sorted({pool.limits for pool in pools}))
    return f"sandbox {'/'.join(modes)}" + (f" ({workers} workers, limits {limits})" if "bubblewrap" in modes else "")


def job_run(
    request_json: Annotated[str, typer.Argument(help="the LaunchRequest as JSON; its program is a path")],
    user: Annotated[str, typer.Option()] = "local",
) -> None:
    """(The entrypoint of `pie submit --jobs`, run inside the Ray job.)"""
    from pie_cluster.cli.jobs import job_run as run
    from pie_cluster.launch_request import LaunchRequest

    raise typer.Exit(run(LaunchRequest.model_validate_json(request_json), user))
