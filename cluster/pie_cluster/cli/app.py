"""The ``pie`` command line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from pie_cluster.cli import operator_commands, user_commands

app = typer.Typer(help="Pie on Ray: a programmable LLM serving cluster.", no_args_is_help=True)
model_app = typer.Typer(help="Models: the embedded default and Hugging Face directories.", no_args_is_help=True)
app.add_typer(model_app, name="model")
console = Console()


@model_app.command("build-default")
def build_default(
    arch: Annotated[str, typer.Option(help="llama (GQA) or qwen3 (q/k norm, tied embeddings)")] = "llama",
    out: Annotated[Path | None, typer.Option(help="write here instead of the user cache")] = None,
) -> None:
    """Build the tiny random-weight default model (offline, deterministic) and print its directory."""
    from pie_workers.tiny_model import build_tiny_model, default_model_path

    if arch not in ("llama", "qwen3"):
        raise typer.BadParameter(f"unknown arch {arch!r}; choose llama or qwen3")
    print(build_tiny_model(out, arch) if out else default_model_path(arch))


@model_app.command("info")
def model_info(model_dir: Path) -> None:
    """Show what the runner reads from a Hugging Face model directory's config.json."""
    from pie_workers.config import ModelConfig

    cfg = ModelConfig.from_dir(model_dir)
    for key, value in vars(cfg).items():
        console.print(f"[bold]{key}[/bold]: {value}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(
    ctx: typer.Context,
    program: Annotated[Path, typer.Argument(help="inferlet file defining `async def main(input)`")],
    model: Annotated[Path | None, typer.Option(help="HF model directory (default: the embedded tiny model)")] = None,
    model_name: Annotated[str, typer.Option(help="the name inferlets load the model by")] = "default",
    tp: Annotated[int, typer.Option(help="tensor-parallel size")] = 1,
    pages: Annotated[int, typer.Option(help="KV pool size in pages")] = 4096,
    backend: Annotated[
        str,
        typer.Option(help="model backend: torch, vllm (vLLM's kernels), or auto (vllm where installed, on a CPU)"),
    ] = "auto",
    stdout: Annotated[bool, typer.Option("--stdout", help="relay what the inferlet prints")] = False,
    user: Annotated[str, typer.Option(help="username the inferlet runs as")] = "local",
    token_budget: Annotated[
        int | None, typer.Option(min=0, help="tokens it may generate; also its market endowment (default 64 credits)")
    ] = None,
) -> None:
    """Run one inferlet on an embedded local Ray and print its return value. Arguments after `--` become its input
    (`--key value` -> {"key": value}, kebab-case to snake_case, numbers and true/false parsed, bare words under
    "_positional")."""
    import asyncio

    from pie_workers.engine.scheduler import BatchLimits
    from pie_workers.rank_threads import usable_cores
    from pie_workers.replica import Replica
    from pie_workers.runner_settings import RunnerSettings
    from pie_workers.tiny_model import default_model_path

    from pie_cluster.bus import start_bus
    from pie_cluster.cli.arguments import fold_arguments
    from pie_cluster.control.cpu_share import ModelShape, NodeRoom, automatic_cpus_per_rank
    from pie_cluster.hosts.in_process import LocalTrust
    from pie_cluster.hosts.run import encode_return, endpoints_for, load_program, run_inferlet
    from pie_cluster.market import endowment_for, get_or_create_market
    from pie_cluster.ray_session import init_ray

    try:  # what it is asked to run and with what, checked before anything starts
        main = load_program(program)
        settings = RunnerSettings(num_pages=pages, backend=backend)
    except (ValueError, SyntaxError, ImportError) as e:
        console.print(f"[red]error:[/red] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(2) from None
    # the rank gets what this machine spares, split among its tp ranks (cpu_share.py), as `pie start` does
    cpus_per_rank = automatic_cpus_per_rank([NodeRoom(usable_cores())], [ModelShape(tensor_parallel=tp)])
    init_ray(num_cpus=max(2, tp * cpus_per_rank))
    import ray

    market = get_or_create_market(ray.get_runtime_context().namespace)
    trust = LocalTrust()  # this run's own secret: its replica and bus verify the capability it mints for the inferlet
    bus = start_bus(shards=1, detached=False, secret=trust.secret)  # messaging and broadcast work as under `pie start`
    replica = Replica(
        model or default_model_path("llama"),
        tp,
        settings,
        cpus_per_rank,
        engine=BatchLimits(),
        market=market,
        secret=trust.secret,
        fit_threads=True,
    )
    try:
        result = asyncio.run(
            run_inferlet(
                main,
                fold_arguments(ctx.args),
                endpoints_for(model_name, replica),
                user,
                **trust.instance(user),
                output=None if stdout else (lambda stream, text: None),
                bus=bus.addresses(),
                market=market,
                endowment=endowment_for(token_budget, replica.info.page_size),
                token_budget=token_budget,
            )
        )
    except Exception as e:
        console.print(f"[red]error:[/red] {type(e).__name__}: {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(1) from None
    finally:
        replica.shutdown()
        bus.shutdown()
    print(encode_return(result))


_passthrough = {"allow_extra_args": True, "ignore_unknown_options": True}
app.command(context_settings=_passthrough)(user_commands.submit)
app.command()(user_commands.upload)
app.command("list")(user_commands.list_instances)
app.command()(user_commands.attach)
app.command()(user_commands.abort)
app.command()(operator_commands.start)
app.command()(operator_commands.stop)
app.command()(operator_commands.status)
app.command()(operator_commands.drain)
app.command("job-run", hidden=True)(operator_commands.job_run)

if __name__ == "__main__":
    app()
