"""``pie submit / upload / list / attach / abort``: the client side of a running cluster, over its HTTP endpoint.

Where to connect comes from ``--url``/``--token``, else ``$PIE_URL``/``$PIE_TOKEN``, else what ``pie start`` wrote
to ``$PIE_HOME/cluster.json``. Streaming follows Pie's client: output lines are prefixed ``[Instance abcd1234]``,
the return value goes to stdout, an error exits 1; Ctrl-C aborts the instance, Ctrl-D (on a terminal) detaches
and leaves it running (``pie attach`` picks it up again, replaying buffered events).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pie_cluster.cli.arguments import fold_arguments
from pie_cluster.cli.state import load_state
from pie_cluster.client import PieClient, PieClientError
from pie_cluster.launch_request import LaunchRequest, describe_errors

err = Console(stderr=True)

UrlOption = Annotated[str | None, typer.Option(help="the cluster's HTTP endpoint (default: $PIE_URL or pie start's)")]
TokenOption = Annotated[str | None, typer.Option(help="bearer token (default: $PIE_TOKEN or pie start's)")]


def connect(url: str | None, token: str | None) -> PieClient:
    state = load_state()
    url = url or os.environ.get("PIE_URL") or state.get("url")
    if not url:
        err.print("[red]error:[/red] no cluster endpoint: pass --url, set PIE_URL, or run `pie start`")
        raise typer.Exit(1)
    return PieClient(url, token or os.environ.get("PIE_TOKEN") or state.get("token"))


@contextlib.contextmanager
def _refusals() -> Iterator[None]:
    """The endpoint's refusal, printed as an error with exit code 1 (every client command reports them alike)."""
    try:
        yield
    except PieClientError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(1) from None
    except ValidationError as e:
        err.print(f"[red]error:[/red] {escape(describe_errors(e.errors()))}", soft_wrap=True)
        raise typer.Exit(2) from None


def follow(client: PieClient, instance_id: str, since: int = 0) -> int:
    """Print the instance's events until it ends (exit code 0/1), Ctrl-C aborts it, or Ctrl-D detaches (0)."""
    tag = f"[Instance {instance_id[:8]}]"
    events: queue.Queue = queue.Queue()

    def pump() -> None:
        try:
            for event in client.events(instance_id, since):
                events.put(event)
        except Exception as e:  # the stream broke: report it as the instance's outcome
            events.put((-1, "error", f"event stream lost: {e}"))

    threading.Thread(target=pump, daemon=True).start()
    detached = threading.Event()
    if sys.stdin.isatty():
        threading.Thread(target=lambda: (sys.stdin.read(), detached.set()), daemon=True).start()
    line_start = {"stdout": True, "stderr": True}
    while True:
        try:
            index, kind, value = events.get(timeout=0.2)
        except queue.Empty:
            if detached.is_set():
                err.print(f"{tag} detached; `pie attach {instance_id[:8]}` to follow it again")
                return 0
            continue
        except KeyboardInterrupt:
            err.print(f"{tag} Ctrl-C: aborting the instance")
            client.abort(instance_id)
            continue
        if kind in ("stdout", "stderr"):
            stream = sys.stdout if kind == "stdout" else sys.stderr
            for piece in value.splitlines(keepends=True):
                stream.write((f"{tag} " if line_start[kind] else "") + piece)
                line_start[kind] = piece.endswith("\n")
            stream.flush()
        elif kind == "message":
            err.print(f"{tag} Message: {value}", markup=False, highlight=False)
        elif kind == "file":
            err.print(f"{tag} File: {len(value)} bytes")
        elif kind == "return":
            print(value)
            return 0
        elif kind == "error":
            err.print(f"{tag} Error: {value}", markup=False, highlight=False)
            return 1


def submit(
    ctx: typer.Context,
    program: Annotated[Path, typer.Argument(help="a .py inferlet, or a directory with pie.toml")],
    url: UrlOption = None,
    token: TokenOption = None,
    input_json: Annotated[str | None, typer.Option("--input", help="input as JSON (instead of -- args)")] = None,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="print the instance id and return")] = False,
    deadline: Annotated[float | None, typer.Option(help="abort the instance after this many seconds")] = None,
    token_budget: Annotated[
        int | None, typer.Option(min=0, help="tokens it may spend: its market endowment (default: the cluster's)")
    ] = None,
    jobs: Annotated[
        bool,
        typer.Option(
            "--jobs",
            help="operators only: run as a Ray job (Jobs API) instead of over HTTP; it needs Ray's cluster token, "
            "and whoever holds that has the whole cluster",
        ),
    ] = False,
    dashboard: Annotated[str | None, typer.Option(help="Ray dashboard address for --jobs")] = None,
    user: Annotated[str | None, typer.Option(help="--jobs only: user the instance runs as (taken on trust)")] = None,
    job_python: Annotated[str, typer.Option(help="--jobs only: the cluster's python")] = "python",
) -> None:
    """Launch an inferlet on a running cluster and stream its events. Arguments after `--` fold into its input."""
    if input_json is not None and ctx.args:
        err.print("[red]error:[/red] pass the input either as --input JSON or as arguments after --, not both")
        raise typer.Exit(2)
    try:
        data = json.loads(input_json) if input_json is not None else fold_arguments(ctx.args)
    except json.JSONDecodeError as e:
        err.print(f"[red]error:[/red] --input is not valid JSON: {escape(str(e))}")
        raise typer.Exit(2) from None
    with _refusals():
        request = LaunchRequest(program=str(program), input=data, deadline_s=deadline, token_budget=token_budget)
    if jobs:
        from pie_cluster.cli.jobs import submit_job

        raise typer.Exit(submit_job(program, request, dashboard, user, job_python))
    client = connect(url, token)
    with _refusals():
        uploaded = client.upload(program)
        instance_id = client.launch(request.model_copy(update={"program": uploaded["program"]}))
        err.print(f"launched {uploaded['name']} as instance {instance_id}")
        if detach:
            print(instance_id)
            return
        code = follow(client, instance_id)
    raise typer.Exit(code)


def upload(
    program: Annotated[Path, typer.Argument(help="a .py inferlet, or a directory with pie.toml")],
    url: UrlOption = None,
    token: TokenOption = None,
) -> None:
    """Upload a program and print its id (e.g. for the ``inferlet`` field of an OpenAI-compatible request)."""
    with _refusals():
        print(connect(url, token).upload(program)["program"])


def list_instances(url: UrlOption = None, token: TokenOption = None) -> None:
    """Your instances on the cluster (running, and recently finished)."""
    with _refusals():
        instances = connect(url, token).list()
    table = Table(title=f"{len(instances)} instance(s)")
    for column in ("id", "program", "status", "elapsed (s)", "input"):
        table.add_column(column, no_wrap=column != "input")  # ids stay whole: they are what attach/abort take
    for i in instances:
        table.add_row(i["id"], i["program"], i["status"], f"{i['elapsed_s']:.1f}", json.dumps(i["input"])[:60])
    console = Console()
    if not console.is_terminal:  # piped: no terminal width to respect, and ids must come out whole
        console = Console(width=200)
    console.print(table)


def attach(
    prefix: Annotated[str, typer.Argument(help="instance id or a unique prefix of it")],
    url: UrlOption = None,
    token: TokenOption = None,
) -> None:
    """Follow an instance, replaying the events it buffered while nobody watched."""
    client = connect(url, token)
    with _refusals():
        instance_id = client.resolve(prefix)
        err.print(f"attached to instance {instance_id}")
        code = follow(client, instance_id)
    raise typer.Exit(code)


def abort(
    prefix: Annotated[str, typer.Argument(help="instance id or a unique prefix of it")],
    url: UrlOption = None,
    token: TokenOption = None,
) -> None:
    """Stop one of your instances; what it held (pages, subscriptions) is released."""
    client = connect(url, token)
    with _refusals():
        instance_id = client.resolve(prefix)
        stopped = client.abort(instance_id)
    err.print(f"instance {instance_id}: " + ("abort sent" if stopped else "had already ended"))
