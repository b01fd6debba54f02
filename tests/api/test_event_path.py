"""No cluster-wide actor on the per-event path: an instance's events go from where it runs to its client.

Counted by the launcher itself (``stats().calls``, shown by `pie status --json`): an uploaded program's instance
streamed over HTTP, and an OpenAI request served by the built-in program in the ingress, cost the launcher the same
calls whether they produce a handful of events or hundreds. An OpenAI request is still an instance of its user:
listed, and ended by ``DELETE /v1/instances/{id}`` like any other; and the ingress's histograms split its time.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.pie_procs import engine_status, started_pie

MODEL = "default"
ALICE = {"Authorization": "Bearer tok-alice"}
BOB = {"Authorization": "Bearer tok-bob"}
PARTS = ("queue", "start", "first_pass", "first_token", "stream")

CHATTY = b"""
import asyncio
from inferlet import session

async def main(input):
    for i in range(input["n"]):
        session.send(str(i))
        await asyncio.sleep(0)  # one event per loop turn: nothing merges them
    return "done"
"""


LIMITS = """
[launcher]
max_running_per_user = 2
max_queued_per_user = 2
"""


@pytest.fixture(scope="module")
def pie(ray_cluster, tmp_path_factory):
    yield from started_pie(ray_cluster, tmp_path_factory.mktemp("pie-event-path"), LIMITS)


def launcher_calls(pie) -> int:
    return sum(engine_status(pie)["launcher"]["calls"].values())


def sse_events(response: httpx.Response) -> list[tuple[str, str]]:
    events, kind = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            kind = line[len("event: ") :]
        elif line.startswith("data: ") and kind is not None:
            events.append((kind, json.loads(line[len("data: ") :])))
    return events


def streamed_instance(pie, program: str, n: int) -> list[tuple[str, str]]:
    body = {"program": program, "input": {"n": n}}
    with httpx.stream("POST", f"{pie['url']}/v1/instances?stream=true", json=body, headers=ALICE, timeout=120) as got:
        return sse_events(got)


def test_an_instances_events_cost_the_launcher_the_same_calls_for_5_or_400_of_them(pie):
    upload = httpx.post(f"{pie['url']}/v1/programs?filename=chatty.py", content=CHATTY, headers=ALICE, timeout=60)
    program = upload.json()["program"]
    costs, counts = [], []
    for n in (5, 400):
        before = launcher_calls(pie)
        events = streamed_instance(pie, program, n)
        costs.append(launcher_calls(pie) - before)
        counts.append(len(events))
        assert events[-1] == ("return", "done")
        assert [v for k, v in events if k == "message"] == [str(i) for i in range(n)]
    assert counts[1] - counts[0] >= 395
    assert costs[0] == costs[1] <= 4  # launch, locate (the stream asks once where it runs), its ending


ECHO = b"""
from inferlet import session

async def main(input):
    return [await session.receive() for _ in range(input["n"])]
"""


def test_session_messages_to_an_instance_ask_the_launcher_where_it_runs_once(pie):
    """The first message asks the launcher which host runs the instance; the rest go straight to that host, which
    still refuses them to another user; once the instance has ended, a message is refused as before."""
    upload = httpx.post(f"{pie['url']}/v1/programs?filename=echo.py", content=ECHO, headers=ALICE, timeout=60)
    launched = httpx.post(
        f"{pie['url']}/v1/instances", json={"program": upload.json()["program"], "input": {"n": 6}}, headers=ALICE
    )
    instance = launched.json()["id"]
    messages = f"{pie['url']}/v1/instances/{instance}/messages"
    before = launcher_calls_of(pie, "locate")
    sent = [httpx.post(messages, json={"message": f"m{i}"}, headers=ALICE, timeout=60) for i in range(5)]
    assert [r.status_code for r in sent] == [204] * 5, [r.text for r in sent]
    assert launcher_calls_of(pie, "locate") - before == 1
    forged = httpx.post(messages, json={"message": "from bob"}, headers=BOB, timeout=60)
    assert forged.status_code == 404, forged.text
    assert httpx.post(messages, json={"message": "m5"}, headers=ALICE, timeout=60).status_code == 204
    with httpx.stream("GET", f"{messages.removesuffix('/messages')}/events", headers=ALICE, timeout=120) as got:
        events = sse_events(got)
    assert events[-1] == ("return", json.dumps([f"m{i}" for i in range(6)])), events
    late = httpx.post(messages, json={"message": "too late"}, headers=ALICE, timeout=60)
    assert late.status_code == 400 and "has ended" in late.json()["detail"], late.text


def chat_stream(pie, max_tokens: int, headers=ALICE, into: list | None = None) -> list[dict]:
    """The chunks of a greedy streamed chat completion (appended to ``into`` as they arrive, when given)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count."}], "max_tokens": max_tokens}
    body |= {"stream": True, "ignore_eos": True, "temperature": 0}
    chunks = [] if into is None else into
    with httpx.stream("POST", f"{pie['url']}/v1/chat/completions", json=body, headers=headers, timeout=120) as got:
        assert got.status_code == 200
        for line in got.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    return chunks


def launcher_calls_of(pie, method: str) -> int:
    return engine_status(pie)["launcher"]["calls"].get(method, 0)


def test_an_openai_request_costs_the_launcher_one_report_of_its_start_and_end_however_long_it_runs(pie):
    """The ingress replica admits a request on a slot of its lease: the launcher hears of it in the replica's
    reports (its start, its end), and is asked for a slot only when the lease has none free: a request right after
    another of the same user's reuses that one's slot."""
    leases, reports = [], []
    for max_tokens in (2, 96):
        before = launcher_calls_of(pie, "lease"), launcher_calls_of(pie, "report")
        chunks = chat_stream(pie, max_tokens)
        leases.append(launcher_calls_of(pie, "lease") - before[0])
        reports.append(launcher_calls_of(pie, "report") - before[1])
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert leases[0] <= 1 and leases[1] == 0, leases  # the second took the slot the first had freed
    assert all(1 <= n <= 3 for n in reports), reports  # its start and end (one report, or two): nothing per token
    listed = httpx.get(f"{pie['url']}/v1/instances", headers=ALICE).json()
    served = [i for i in listed if i["program"].startswith("openai_completions@")]
    assert len(served) == 2 and {i["status"] for i in served} == {"finished"}
    assert all(i["input"] == {} for i in served)  # the launcher never sees the prompt


def test_an_openai_request_is_aborted_by_its_instance_id_and_frees_its_pages(pie):
    got: list[dict] = []
    streaming = threading.Thread(target=lambda: got.extend(chat_stream(pie, 100000, BOB)))
    streaming.start()
    deadline = time.time() + 60
    running = []
    while not running and time.time() < deadline:
        running = [i for i in httpx.get(f"{pie['url']}/v1/instances", headers=BOB).json() if i["status"] == "running"]
        time.sleep(0.2)
    (instance,) = running
    assert httpx.delete(f"{pie['url']}/v1/instances/{instance['id']}", headers=ALICE).status_code == 404  # not hers
    assert httpx.delete(f"{pie['url']}/v1/instances/{instance['id']}", headers=BOB).json() == {"aborted": True}
    streaming.join(60)
    assert not streaming.is_alive()
    assert "aborted by its user" in json.dumps(got[-1])  # the stream's last chunk is the error
    (listed,) = [i for i in httpx.get(f"{pie['url']}/v1/instances", headers=BOB).json() if i["id"] == instance["id"]]
    assert listed["status"] == "failed"
    (replica,) = engine_status(pie)["replicas"]
    assert replica["contexts"] == 0 and replica["pages_used"] == 0


def sample(pie, name: str, **labels) -> float:
    """A sample of the ingress's /metrics (0 when absent)."""
    text = httpx.get(f"{pie['url']}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_metrics_split_a_requests_time_into_queue_start_first_pass_first_token_and_stream(pie):
    names = [f"pie_request_{p}_seconds_{kind}" for p in PARTS for kind in ("count", "sum")]
    names.append("pie_request_seconds_sum")

    def readings() -> dict[str, float]:
        return {name: sample(pie, name, route="chat", model=MODEL) for name in names}

    before = readings()
    chat_stream(pie, 8)
    took = {name: value - before[name] for name, value in readings().items()}
    assert all(took[f"pie_request_{p}_seconds_count"] == 1 for p in PARTS), took
    assert all(took[f"pie_request_{p}_seconds_sum"] > 0 for p in PARTS), took
    split = took["pie_request_first_token_seconds_sum"] + took["pie_request_stream_seconds_sum"]
    assert abs(split - took["pie_request_seconds_sum"]) < 1e-6  # first token and stream split the whole
    # the replica's answer to the first pass that generated comes back before that token leaves for the client
    assert took["pie_request_first_pass_seconds_sum"] < took["pie_request_first_token_seconds_sum"], took


WAIT = b"from inferlet import session\n\nasync def main(input):\n    return await session.receive()\n"


def chunk_text(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def test_a_chat_over_its_users_limit_waits_for_a_slot_with_nothing_begun_then_runs(pie):
    """Bob's two uploaded instances take both his slots (``max_running_per_user = 2``; the slot his earlier chat
    left in the ingress's lease goes back to the launcher for them). His chat then asks for a slot and waits in the
    launcher's queue: nothing of it has begun (no context, no page, no chunk), and it runs from the start once one
    of his instances ends, to the same answer."""
    expected = chunk_text(chat_stream(pie, 8, BOB))
    waiting = bob_at_his_limit(pie)
    asked = launcher_calls_of(pie, "lease")
    got: list[dict] = []
    streaming = threading.Thread(target=chat_stream, args=(pie, 8, BOB), kwargs={"into": got})
    streaming.start()
    deadline = time.time() + 30
    while launcher_calls_of(pie, "lease") == asked and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # it asked: had it begun anyway, its context would show by now
    (replica,) = engine_status(pie)["replicas"]
    assert replica["contexts"] == 0 and replica["pages_used"] == 0 and not got and streaming.is_alive()
    assert engine_status(pie)["launcher"]["queued"] == 1
    httpx.post(f"{pie['url']}/v1/instances/{waiting[0]}/messages", json={"message": "done"}, headers=BOB)
    streaming.join(120)
    assert not streaming.is_alive() and chunk_text(got) == expected
    assert got[-1]["choices"][0]["finish_reason"] == "length"
    finish_and_free(pie, waiting[1:])


def test_a_chat_waiting_for_a_slot_when_the_launcher_is_killed_waits_again_in_the_restarted_ones_queue(pie):
    """SIGKILL the launcher while bob's chat waits in its queue: the queue dies with it, so the ingress asks the
    restarted launcher again (which learned bob's two running instances from their host) and the chat waits there,
    then runs to the same answer once a slot frees."""
    import os
    import signal

    from ray.util.state import list_actors

    expected = chunk_text(chat_stream(pie, 8, BOB))
    waiting = bob_at_his_limit(pie)
    got: list[dict] = []
    try:
        streaming = threading.Thread(target=chat_stream, args=(pie, 8, BOB), kwargs={"into": got})
        streaming.start()
        deadline = time.time() + 30
        while engine_status(pie)["launcher"]["queued"] != 1 and time.time() < deadline:
            time.sleep(0.1)
        (launcher,) = list_actors(filters=[("name", "=", "pie-launcher"), ("state", "=", "ALIVE")])
        os.kill(launcher["pid"], signal.SIGKILL)
        killed = time.monotonic()
        while True:  # the restarted launcher has it in its queue again
            try:
                if engine_status(pie)["launcher"]["queued"] == 1:
                    break
            except Exception:  # `pie status` fails while the launcher restarts
                pass
            assert streaming.is_alive(), "the chat ended while the launcher restarted"
            assert time.monotonic() - killed < 60, "the chat was not queued again within 60 s of the launcher's kill"
            time.sleep(0.2)
        print(f"the chat waited in the restarted launcher's queue {time.monotonic() - killed:.1f} s after its kill")
        assert streaming.is_alive() and not got
        httpx.post(f"{pie['url']}/v1/instances/{waiting[0]}/messages", json={"message": "done"}, headers=BOB)
        streaming.join(120)
        assert not streaming.is_alive() and chunk_text(got) == expected
    finally:
        finish_and_free(pie, waiting)


def bob_at_his_limit(pie) -> list[str]:
    """Two running instances of bob's, which take both his slots (``max_running_per_user = 2``) until each is sent
    a message."""
    upload = httpx.post(f"{pie['url']}/v1/programs?filename=wait.py", content=WAIT, headers=BOB, timeout=60)
    body = {"program": upload.json()["program"]}
    waiting = [httpx.post(f"{pie['url']}/v1/instances", json=body, headers=BOB).json()["id"] for _ in range(2)]

    def statuses() -> list[str]:
        listed = httpx.get(f"{pie['url']}/v1/instances", headers=BOB).json()
        return [i["status"] for i in listed if i["id"] in waiting]

    deadline = time.time() + 30
    while statuses() != ["running", "running"] and time.time() < deadline:
        time.sleep(0.1)
    assert statuses() == ["running", "running"]
    return waiting


def finish_and_free(pie, instances: list[str]) -> None:
    """End bob's ``instances`` (those still running); then every slot is back (no lease holds one idle for long)."""
    for instance in instances:
        httpx.post(f"{pie['url']}/v1/instances/{instance}/messages", json={"message": "done"}, headers=BOB)
    deadline = time.time() + 30
    while engine_status(pie)["launcher"]["running"] and time.time() < deadline:
        time.sleep(0.1)
    assert engine_status(pie)["launcher"]["running"] == 0


def test_a_chat_whose_client_leaves_while_it_waits_for_a_slot_leaves_no_slot_taken(pie):
    """A request queued behind its user's limit whose client goes away is ended at the launcher (when Serve cancels
    its handler) or served once a slot frees (when it does not): either way, afterwards nothing of it runs or
    waits."""
    upload = httpx.post(f"{pie['url']}/v1/programs?filename=wait.py", content=WAIT, headers=BOB, timeout=60)
    body = {"program": upload.json()["program"]}
    waiting = [httpx.post(f"{pie['url']}/v1/instances", json=body, headers=BOB).json()["id"] for _ in range(2)]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Count."}], "max_tokens": 8}
    with pytest.raises(httpx.ReadTimeout):  # bob is at his limit: the request waits, and its client gives up
        httpx.post(f"{pie['url']}/v1/chat/completions", json=chat, headers=BOB, timeout=httpx.Timeout(60, read=2))
    for instance in waiting:
        httpx.post(f"{pie['url']}/v1/instances/{instance}/messages", json={"message": "done"}, headers=BOB)
    deadline = time.time() + 60
    while (launcher := engine_status(pie)["launcher"])["running"] + launcher["queued"] and time.time() < deadline:
        time.sleep(0.2)
    assert launcher["running"] == launcher["queued"] == 0, launcher
    listed = httpx.get(f"{pie['url']}/v1/instances", headers=BOB).json()
    assert all(i["status"] in ("finished", "failed") for i in listed), listed


def test_a_killed_ingress_replica_is_replaced_and_its_requests_end_without_leaking_a_slot(pie):
    """SIGKILL the Serve replica that runs the OpenAI requests while one streams: that stream breaks off, Serve
    starts a new replica, the launcher ends the lost request (its admission slot comes back), the replica releases
    its pages, and requests are served again."""
    import os
    import signal

    from ray.util.state import list_actors

    def ingress() -> list[dict]:
        alive = list_actors(filters=[("state", "=", "ALIVE")], limit=10_000)
        return [a for a in alive if a["class_name"].startswith("ServeReplica:")]

    (doomed,) = ingress()
    broke: list[BaseException] = []

    def stream() -> None:
        try:
            chat_stream(pie, 100000)
        except BaseException as e:  # the connection drops, or the stream ends with an error chunk
            broke.append(e)

    streaming = threading.Thread(target=stream)
    streaming.start()
    deadline = time.time() + 60
    while engine_status(pie)["launcher"]["running"] == 0 and time.time() < deadline:
        time.sleep(0.2)
    os.kill(doomed["pid"], signal.SIGKILL)
    killed = time.monotonic()
    streaming.join(120)
    assert not streaming.is_alive()
    while True:  # until a request is served again
        try:
            if chat_stream(pie, 4)[-1]["choices"][0]["finish_reason"] == "length":
                break
        except (httpx.HTTPError, AssertionError):
            assert time.monotonic() - killed < 120, "no request was served within 120 s of the kill"
            time.sleep(0.5)
    print(f"requests were served again {time.monotonic() - killed:.1f} s after the ingress replica's SIGKILL")
    assert [a["pid"] for a in ingress()] != [doomed["pid"]]
    deadline = time.time() + 30  # (the new replica's lease keeps the slot it served with for a moment)
    while (status := engine_status(pie))["launcher"]["running"] and time.time() < deadline:
        time.sleep(0.2)
    assert status["launcher"]["running"] == 0, status["launcher"]  # the lost request's slot came back
    (replica,) = status["replicas"]
    assert replica["contexts"] == 0 and replica["pages_used"] == 0


def test_an_openai_stream_outlives_the_model_replica_it_started_on(pie):
    """SIGKILL the model's only replica while a greedy chat completion streams: the serving program's contexts wait
    for the replacement (reached through the ingress's relay), are recomputed there, and the stream goes on to the
    same tokens an undisturbed request gets."""
    import os
    import signal

    expected = chat_stream(pie, 200)
    got: list[dict] = []
    streaming = threading.Thread(target=chat_stream, args=(pie, 200), kwargs={"into": got})
    (before,) = engine_status(pie)["replicas"]
    streaming.start()
    while not got and streaming.is_alive():  # the first chunks are out: it is generating
        time.sleep(0.01)
    os.kill(before["pids"][0], signal.SIGKILL)
    streaming.join(180)
    assert not streaming.is_alive()

    assert chunk_text(got) == chunk_text(expected), json.dumps(got[-2:])
    assert got[-1]["choices"][0]["finish_reason"] == "length"
    (after,) = engine_status(pie)["replicas"]
    assert after["state"] == "serving" and not set(after["pids"]) & set(before["pids"])


def test_pie_drain_names_what_it_did_and_refuses_what_it_cannot(pie):
    """Last in the module: it takes a node out of this cluster's use."""
    import subprocess

    from support.pie_procs import PIE

    def drain(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*PIE, "drain", *args], env=pie["env"], capture_output=True, text=True, timeout=300)

    unknown = drain("no-such-node")
    assert unknown.returncode == 1 and "names 0 of the nodes" in unknown.stderr, unknown.stderr
    neither = drain()
    assert neither.returncode == 1 and "name one node, or pass --this-node" in neither.stderr, neither.stderr
    nodes = [n["node"] for n in engine_status(pie)["nodes"]]
    drained = drain(nodes[-1][:12], "--timeout", "5")
    assert drained.returncode == 0, drained.stderr
    assert f"node {nodes[-1][:8]} drained" in drained.stdout and "0 instance(s) finished" in drained.stdout
    status = engine_status(pie)
    assert [n["node"] for n in status["nodes"]] == nodes[:-1]
    assert [n["node"] for n in status["drained"]] == [nodes[-1]]
    assert chat_stream(pie, 4)[-1]["choices"][0]["finish_reason"] == "length"  # still serving
