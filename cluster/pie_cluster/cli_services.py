"""``pie start / stop / status / job-run``: bringing Pie's services up on a Ray cluster and looking at them.

``pie start`` joins the Ray cluster at ``--address`` (or the one running on this machine, or starts a local head
with ``ray start --head`` when there is none), creates the detached controller (replicas, bus, hosts, launcher)
in the ``pie`` namespace, deploys the HTTP endpoint on Ray Serve, and records where it all is for the other
commands. ``pie stop`` undoes it (and stops the Ray head if ``pie start`` started it).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from pie_cluster.state import clear_state, load_state, save_state

console = Console()
err = Console(stderr=True)

AddressOption = Annotated[str | None, typer.Option(help="Ray cluster address (default: the one on this machine)")]


def _join(address: str | None, start_if_missing: bool) -> tuple[str, str | None, bool]:
    """Connect to Ray; returns (address, dashboard address, whether we started a head for it)."""
    import ray

    from pie_cluster.local_ray import init_ray

    started = False
    if address is None:
        try:
            dashboard = init_ray(address="auto")
        except ConnectionError:
            if not start_if_missing:
                raise
            subprocess.run(["ray", "start", "--head", "--disable-usage-stats"], check=True, capture_output=True)
            started = True
            dashboard = init_ray(address="auto")
    else:
        dashboard = init_ray(address=address)
    return ray.get_runtime_context().gcs_address, dashboard, started


def start(
    config: Annotated[Path | None, typer.Option(help="config.toml (default: the embedded model, auth on)")] = None,
    address: AddressOption = None,
    host: Annotated[str | None, typer.Option(help="HTTP bind address (overrides [server].host)")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port (overrides [server].port)")] = None,
    no_auth: Annotated[bool, typer.Option("--no-auth", help="accept every caller as user `local`")] = False,
) -> None:
    """Start Pie's services on the Ray cluster (or join the ones already running there)."""
    import ray

    from pie_cluster.config import PieConfig
    from pie_cluster.controller import start_controller
    from pie_cluster.http_app import serve_http

    try:
        cfg = PieConfig.load(config)
        if no_auth:
            cfg.auth.enabled = False
        cfg.check_auth()
    except ValueError as e:
        err.print(f"[red]error:[/red] {e}", markup=False)
        raise typer.Exit(2) from None
    gcs, dashboard, started = _join(address, start_if_missing=True)
    with err.status("starting Pie services (loading models)..."):
        start_controller(cfg)
        url = serve_http(
            cfg.auth,
            ray.get_runtime_context().namespace,
            host or cfg.server.host,
            port or cfg.server.port,
            cfg.server.max_ongoing_requests,
        )
    token = next(iter(cfg.auth.tokens), None) if cfg.auth.enabled and len(cfg.auth.tokens) == 1 else None
    save_state({"address": gcs, "url": url, "dashboard": dashboard, "started_ray": started, "token": token})
    console.print(f"[green]✓[/green] Pie is up: {url}  (Ray at {gcs})")


def stop(address: AddressOption = None) -> None:
    """Stop Pie's services (and the local Ray head, if `pie start` started it)."""
    from pie_cluster.controller import stop_controller
    from pie_cluster.http_app import stop_http

    state = load_state()
    _join(address or state.get("address"), start_if_missing=False)
    stop_http()
    stopped = stop_controller()
    if state.get("started_ray") and address is None:
        subprocess.run(["ray", "stop"], check=False, capture_output=True)
    clear_state()
    console.print("[green]✓[/green] Pie stopped" if stopped else "no Pie services were running")


def status(
    address: AddressOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the raw status as JSON")] = False,
) -> None:
    """Replicas (pages used/total, suspended contexts, page price, queue, batches), instances, wallets, bus."""
    import ray

    from pie_cluster.controller import find_controller

    _join(address or load_state().get("address"), start_if_missing=False)
    try:
        report = ray.get(find_controller().status.remote())
    except RuntimeError as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from None
    if as_json:
        print(json.dumps(report, indent=2))
        return
    table = Table(title="replicas")
    columns = ("model", "#", "node", "TP", "device", "pages used / total", "cached", "suspended", "price", "queued")
    for column in (*columns, "batches"):
        table.add_column(column)
    for r in report["replicas"]:
        table.add_row(
            r["model"],
            str(r["replica"]),
            r["node"][:8],
            str(r["tensor_parallel"]),
            r["device"],
            f"{r['pages_used']} / {r['pages_total']}",
            str(r["pages_cached"]),
            str(r["suspended"]),
            f"{r['price']:g}",
            str(r["queued"]),
            str(r["batches"]),
        )
    console.print(table)
    launcher = report["launcher"]
    console.print(
        f"nodes {report['nodes']} · instances running {launcher['running']} (launched {launcher['launched']}) · "
        f"bus topics {report['bus']['topics']}, subscriptions {report['bus']['subscriptions']} · "
        f"wallets {report['market']['wallets']} holding {report['market']['held']:g} credits"
    )


def job_run(
    request_json: Annotated[str, typer.Argument(help="the LaunchRequest as JSON; its program is a path")],
    user: Annotated[str, typer.Option()] = "local",
) -> None:
    """(The entrypoint of `pie submit --jobs`, run inside the Ray job.)"""
    from pie_cluster.jobs import job_run as run
    from pie_cluster.launch_request import LaunchRequest

    raise typer.Exit(run(LaunchRequest.model_validate_json(request_json), user))
