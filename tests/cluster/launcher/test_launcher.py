"""The launcher's instances, on the same kind of two-node cluster as ``test_cluster.py``: session messages, files
and output streamed in order; cleanup after inferlets that are aborted, time out or raise; token budgets that endow
an instance and end it when spent; other users kept out of an instance and of the program store; clear errors for
bad programs and launches; and, sandboxed (the default), isolated programs kept on the node's pooled host and a
manifest's runtime_env refused (with the sandbox off: ``test_trusted_mode.py``).
"""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import ray
from pie_cluster.hosts.driver_events import deliver, poll
from pie_cluster.launcher.actor import NotFound
from support.launching import LONG, engine_stats, launch, run_to_end, upload
from support.program_zips import isolated_shouter, zip_program

SESSION = """
import sys
from inferlet import session

async def main(input):
    print("hello from", input["who"])
    print("to stderr", file=sys.stderr)
    session.send({"asking": "name"})
    name = await session.receive()
    blob = await session.receive_file()
    session.send_file(blob[::-1])
    return f"hi {name} ({len(blob)} bytes)"
"""


def test_session_messages_files_and_output_stream_in_order(launcher):
    instance = launch(launcher, upload(launcher, SESSION), {"who": "bob"})
    first = poll(launcher, "alice", instance, 0, 30.0)
    while len(first.events) < 3:  # stdout, stderr, message
        more = poll(launcher, "alice", instance, first.next_index, 30.0)
        first = dataclasses.replace(more, events=first.events + more.events)
    deliver(launcher, "alice", instance, "carol")
    deliver(launcher, "alice", instance, b"\x00\x01\x02")
    events = run_to_end(launcher, instance)
    kinds = [(k, v) for _, k, v in events]
    assert kinds == [
        ("stdout", "hello from bob\n"),
        ("stderr", "to stderr\n"),
        ("message", '{"asking": "name"}'),
        ("file", b"\x02\x01\x00"),
        ("return", "hi carol (3 bytes)"),
    ]
    assert [e[0] for e in events] == list(range(len(events)))  # numbered, so a client resumes where it left off


@pytest.mark.parametrize("how", ["abort", "deadline", "raise"])
def test_an_inferlet_that_is_aborted_times_out_or_raises_leaves_nothing_behind(cluster, launcher, how):
    bus_before = ray.get(cluster.status.remote()).bus
    program = upload(launcher, LONG)
    deadline = 3.0 if how == "deadline" else None
    instance = launch(launcher, program, {"how": how}, deadline_s=deadline)
    if how == "abort":
        time.sleep(2.0)  # let it generate for a while
        assert ray.get(launcher.abort.remote("alice", instance)) is True
    events = run_to_end(launcher, instance)
    kind, value = events[-1][1], events[-1][2]
    assert kind == "error"
    expected = {"abort": "aborted", "deadline": "deadline exceeded", "raise": "RuntimeError: the inferlet gave up"}
    assert expected[how] in value
    if how == "raise":
        assert "line 11" in value  # where in the program it was raised
    status = ray.get(cluster.status.remote())
    for replica in status.replicas:
        assert replica.contexts == 0 and replica.pages_used == 0
    assert status.bus.subscriptions == bus_before.subscriptions
    market = ray.get_actor("pie-market")
    assert ray.get(market.accounts.remote([instance])) == {}, "its wallet is still open"
    assert status.market.wallets == 0 and status.market.balanced
    assert ray.get(launcher.abort.remote("alice", instance)) is False  # already ended


BUDGETED = """
from inferlet import Context, Model, Sampler, scheduling
from pie_workers.wire.pages import pages_for

async def main(input):
    model = Model.load("default")
    before = scheduling.balance(model)
    with Context(model) as ctx:
        ctx.append([300 + (i * 11) % 97 for i in range(50)])  # no other test's prefix: every page is made here
        await ctx.generate(Sampler.argmax(), max_tokens=40, auto_flush=False).collect_tokens()
        pages = pages_for(ctx.seq_len, ctx.page_size)
    return {"before": before, "pages": pages, "price": scheduling.price()}
"""


def test_a_token_budget_endows_the_instance_and_its_wallet_closes_when_it_ends(cluster, launcher):
    market = ray.get_actor("pie-market")
    ledger_before = ray.get(market.ledger.remote())
    program = upload(launcher, BUDGETED)
    instance = launch(launcher, program, token_budget=1000)
    events = run_to_end(launcher, instance)
    assert events[-1][1] == "return", events
    import json

    got = json.loads(events[-1][2])
    assert got["before"] == 63.0 and got["price"] == 1.0  # ceil(1000 / 16) credits, one per page it can make
    ledger = ray.get(market.ledger.remote())
    assert ledger.issued - ledger_before.issued == 63 * 1_000_000
    assert (ledger.burned - ledger_before.burned) / 1_000_000 == got["pages"]  # settled before its wallet closed
    assert ledger.held == 0 and ledger.balanced  # its balance went out with it
    with pytest.raises(ValueError, match="token_budget"):
        ray.get(launcher.launch.remote("alice", {"program": program, "token_budget": -5}))


OVERSPENDER = """
from inferlet import Context, Model, Sampler, TokenBudgetExhausted

async def main(input):
    model = Model.load("default")
    with Context(model) as ctx:
        ctx.user("Keep talking.")
        if input.get("catch"):
            try:
                await ctx.generate(Sampler.argmax(), max_tokens=64, stop=[]).collect_tokens()
            except TokenBudgetExhausted as e:
                return str(e)
        return await ctx.generate(Sampler.argmax(), max_tokens=64, stop=[]).collect_tokens()
"""


def test_an_instance_past_its_token_budget_fails_and_frees_its_pages(cluster, launcher):
    program = upload(launcher, OVERSPENDER)
    events = run_to_end(launcher, launch(launcher, program, token_budget=20))
    assert events[-1][1] == "error" and "token budget exhausted" in events[-1][2] and "budget is 20" in events[-1][2]
    caught = run_to_end(launcher, launch(launcher, program, {"catch": True}, token_budget=20))[-1]
    assert caught[1] == "return" and "token budget exhausted" in caught[2]  # an inferlet may handle it itself
    for replica in engine_stats(cluster):
        assert replica.contexts == 0 and replica.pages_used == 0
    enough = run_to_end(launcher, launch(launcher, program, token_budget=64))
    assert enough[-1][1] == "return" and len(json.loads(enough[-1][2])) == 64


def test_other_users_cannot_see_attach_to_message_or_abort_an_instance(launcher):
    program = upload(launcher, "async def main(input):\n    return 'mine'\n")
    instance = launch(launcher, program)
    run_to_end(launcher, instance)
    assert instance in [i.id for i in ray.get(launcher.list.remote("alice"))]
    assert instance not in [i.id for i in ray.get(launcher.list.remote("bob"))]
    for call in (launcher.locate.remote("bob", instance, 0.1), launcher.abort.remote("bob", instance)):
        with pytest.raises(NotFound, match="no instance"):
            ray.get(call)
    host = ray.get(launcher.locate.remote("alice", instance)).host  # where its events and inbox are kept
    for call in (host.events.remote("bob", instance, 0, 0.1), host.send.remote("bob", instance, "message", "hi")):
        with pytest.raises(NotFound, match="no instance"):
            ray.get(call)


def test_another_users_program_id_is_unknown_to_them_and_the_store_is_private(launcher, store_parent):
    program = upload(launcher, "async def main(input):\n    return 'mine'\n")
    with pytest.raises(NotFound, match=f"no program '{program}'; upload it first"):  # as for an unknown id
        launch(launcher, program, user="bob")
    assert upload(launcher, "async def main(input):\n    return 'mine'\n", user="bob") == program  # his own now
    assert run_to_end(launcher, launch(launcher, program, user="bob"), user="bob")[-1][1:] == ["return", "mine"]
    (store,) = store_parent.iterdir()
    assert store.stat().st_mode & 0o777 == 0o700


def test_bad_programs_and_launches_get_clear_errors(launcher):
    from pie_cluster.programs.program import ProgramError

    with pytest.raises(ProgramError, match="line 1"):
        ray.get(launcher.upload.remote("alice", "bad.py", b"async def main(input) return 1\n"))
    with pytest.raises(NotFound, match="upload it first"):
        launch(launcher, "no-such-program")
    program = upload(launcher, "def main(input):\n    return 1\n")
    events = run_to_end(launcher, launch(launcher, program))
    assert events[-1][1] == "error" and "async def main(input)" in events[-1][2]


def inferlet_host_actors(ray_cluster) -> int:
    """Inferlet host actors this test session's clusters ever made, alive or not."""
    from ray.util.state import list_actors

    made = list_actors(ray_cluster.address, filters=[("class_name", "=", "InferletHost")], detail=True, limit=10_000)
    return sum(a["ray_namespace"] == "pie-test" for a in made)


def test_an_isolated_directory_program_runs_on_the_pooled_host_when_sandboxed(launcher, ray_cluster):
    """Sandboxed, the node's pooled host gives an isolated program a worker of its own: no Ray actor is made for
    it (a dedicated Ray host is what a cluster with the sandbox off makes: test_trusted_mode.py)."""
    data = isolated_shouter("getuid")
    uploaded = ray.get(launcher.upload.remote("alice", "shouter.zip", data))
    assert uploaded.name == "shouter@1.2.3" and uploaded.isolated
    uid = b"import os\nasync def main(input):\n    return os.getuid()\n"
    pooled = ray.get(launcher.upload.remote("alice", "uid.py", uid))
    hosts = inferlet_host_actors(ray_cluster)
    kind, value = run_to_end(launcher, launch(launcher, uploaded.program, {"text": "hey"}))[-1][1:]
    isolated = json.loads(value)
    assert kind == "return" and isolated["text"] == "HEY"
    pooled_uid = json.loads(run_to_end(launcher, launch(launcher, pooled.program, {}))[-1][2])
    assert isolated["process"] != pooled_uid  # a worker of its own (each worker has its own uid on a root host)
    assert inferlet_host_actors(ray_cluster) == hosts


def test_a_manifests_runtime_env_is_refused_when_sandboxed(launcher):
    manifest = """
    [package]
    name = "wider"
    version = "0.1.0"
    [inferlet.runtime_env]
    pip = ["rapidfuzz"]
    """
    data = zip_program({"pie.toml": manifest, "main.py": "async def main(input):\n    return 'never'\n"})
    from pie_cluster.programs.program import ProgramError

    with pytest.raises(ProgramError, match=r"wider@0\.1\.0: pie.toml's \[inferlet.runtime_env\] is refused.*sandbox"):
        ray.get(launcher.upload.remote("alice", "wider.zip", data))
