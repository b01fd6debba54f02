"""The Responses API on a `pie start`ed cluster, driven by the official `openai` client and by an OpenAI Agents SDK
agent: items and string input, continuation by ``previous_response_id`` from the live KV context (only the new
input prefilled: parked in the ingress, then saved as a snapshot; also after the replica holding it died, the
ingress or the response store restarted), streaming events in order, background responses, function tools round
trips, JSON output, ownership, expiry, and the error shapes.

The tiny model's text is gibberish; what is checked is the protocol, the structure and greedy determinism.
One module of ~500 lines on purpose: its tests share one started cluster, whose start costs ~30 CPU-seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Annotated

import httpx
import openai
import pytest
from inferlet.responses_schema import snapshot_name
from pie_cluster.client import PieClient
from pie_cluster.launch_request import LaunchRequest
from pie_cluster.stores.responses import RESPONSES
from pydantic import Field
from support.pie_procs import engine_status, started_pie

MODEL = "default"
TTL_S = 40
RESIDENT_S = 3  # a stored turn keeps its pages this long
PARK_S = 2  # a stored turn's program waits this long for the next turn, then saves the snapshot
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def pie(ray_cluster, tmp_path_factory):
    yield from started_pie(
        ray_cluster,
        tmp_path_factory.mktemp("pie-responses"),
        f"[responses]\nttl_s = {TTL_S}\nresident_s = {RESIDENT_S}\npark_s = {PARK_S}\n",
    )


SNAPSHOT_PROBE = """
from inferlet import Context, Model

async def main(input):
    ctx = Context.open(Model.load("default"), input["name"])
    if ctx is None:
        return "absent"
    ctx.release()
    return "present"
"""


@pytest.fixture(scope="module")
def has_context(pie, tmp_path_factory):
    """Whether alice's stored context of a response exists, asked by an inferlet of hers."""
    path = tmp_path_factory.mktemp("probe") / "probe.py"
    path.write_text(SNAPSHOT_PROBE)
    client = PieClient(pie["url"], "tok-alice")
    program = client.upload(path)["program"]

    def probe(response_id: str) -> bool:
        launch = LaunchRequest(program=program, input={"name": snapshot_name(response_id)})
        (*_, (_, kind, value)) = client.launch_and_follow(launch)
        assert kind == "return", value
        return value == "present"

    return probe


def saved(response_id: str) -> bool:
    """Whether the response's record says its snapshot is saved, within a few park times (its program parks
    first, and saves when the conversation idles)."""
    import ray

    store = ray.get_actor(RESPONSES, namespace="pie")
    for _ in range(40):
        if ray.get(store.get.remote("alice", response_id)).saved:
            return True
        time.sleep(0.5)
    return False


def resent(api, instructions: str | None, turns: list[tuple[str, object]], text: str) -> str:
    """What the chat route answers when the conversation (each turn's input and response) is sent whole: what
    a continuation that renders the history must answer (its text is tokenized again, so it may differ from a
    continued context, which holds the tokens as they were sampled)."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    for said, response in turns:
        messages += [{"role": "user", "content": said}, {"role": "assistant", "content": response.output_text}]
    messages.append({"role": "user", "content": text})
    chat = api.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8)
    return chat.choices[0].message.content


def greedy(api, **kw):
    return api.responses.create(model=MODEL, temperature=0, max_output_tokens=kw.pop("max_output_tokens", 8), **kw)


def test_string_input_answers_a_stored_response_that_get_returns(api):
    got = greedy(api, input="Tell me about paged attention.", instructions="Be brief.")
    assert got.id.startswith("resp_") and got.object == "response" and got.status in ("completed", "incomplete")
    (message,) = got.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert got.output_text == message.content[0].text and got.instructions == "Be brief."
    assert got.usage.input_tokens > 5 and 0 < got.usage.output_tokens <= 8
    assert got.usage.input_tokens_details.cached_tokens == 0
    again = api.responses.retrieve(got.id)
    assert again.id == got.id and again.output_text == got.output_text and again.status == got.status


def test_items_input_equals_the_same_conversation_as_a_string(api):
    text = greedy(api, input="Hello there", store=False).output_text
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}]
    assert greedy(api, input=items, store=False).output_text == text
    assert greedy(api, input=[{"role": "user", "content": "Hello there"}], store=False).output_text == text


def test_a_continuation_prefills_only_the_new_input_and_equals_resending_the_history(api):
    first = greedy(api, input="Tell me a story.", instructions="You are terse.")
    second = greedy(api, input="And then?", instructions="You are terse.", previous_response_id=first.id)
    cached = second.usage.input_tokens_details.cached_tokens
    assert second.previous_response_id == first.id
    assert cached >= first.usage.input_tokens  # the whole first turn came from the stored context
    assert second.usage.input_tokens - cached < 24  # the turn's close, the new user turn and the cue
    third = greedy(api, input="Why?", instructions="You are terse.", previous_response_id=second.id)
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens
    # Other instructions cannot reuse the stored context: the history is rendered again, nothing cached.
    other = greedy(api, input="And then?", instructions="You are verbose.", previous_response_id=first.id)
    assert other.usage.input_tokens_details.cached_tokens == 0
    assert other.usage.input_tokens > first.usage.input_tokens


def test_store_false_is_not_retrievable_and_get_delete_cancel_answer_in_openai_shape(pie, api, has_context):
    unstored = greedy(api, input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as e:
        greedy(api, input="hi", previous_response_id=unstored.id)
    assert e.value.body["param"] == "previous_response_id"
    assert not has_context(unstored.id)
    stored = greedy(api, input="hi")
    with pytest.raises(openai.BadRequestError) as e:
        api.responses.cancel(stored.id)  # finished already
    assert "in progress" in e.value.message
    assert saved(stored.id) and has_context(stored.id)
    api.responses.delete(stored.id)
    assert not has_context(stored.id)
    parked = greedy(api, input="hi")  # deleted while its program is parked: it ends without saving
    api.responses.delete(parked.id)
    time.sleep(PARK_S + 2)
    assert not has_context(parked.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(stored.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.delete(stored.id)


def test_a_response_in_progress_can_be_cancelled_and_keeps_no_context(api, has_context):
    stream = api.responses.create(
        model=MODEL, input="Go on and on.", max_output_tokens=4000, stream=True, extra_body={"ignore_eos": True}
    )
    events = iter(stream)
    created = next(events)
    assert created.type == "response.created"
    while next(events).type != "response.output_text.delta":
        pass
    assert api.responses.retrieve(created.response.id).status == "in_progress"
    cancelled = api.responses.cancel(created.response.id)
    assert cancelled.status == "cancelled"
    assert [e.type for e in events][-1] == "response.failed"
    assert api.responses.retrieve(created.response.id).status == "cancelled"
    assert not has_context(created.response.id)
    with pytest.raises(openai.BadRequestError):
        greedy(api, input="more", previous_response_id=created.response.id)


def test_another_users_response_is_404_and_a_missing_token_is_401(pie, api):
    mine = greedy(api, input="secret")
    bob = openai.OpenAI(base_url=f"{pie['url']}/v1", api_key="tok-bob", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.create(model=MODEL, input="x", previous_response_id=mine.id, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(mine.id)
    assert api.responses.retrieve(mine.id).id == mine.id
    raw = httpx.post(f"{pie['url']}/v1/responses", json={"model": MODEL, "input": "x", "bogus": 1})
    assert raw.status_code == 401 and raw.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": "x", "bogus": 1}, "bogus", "bogus"),
        ({"input": "x", "background": True, "store": False}, "background", "must be stored"),
        ({"input": "x", "background": True, "stream": True}, "background", "cannot be streamed"),
        ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include", "not supported"),
        ({"input": [{"type": "image", "url": "x"}]}, "input", "input"),
        ({"input": "x", "previous_response_id": "nope"}, "previous_response_id", "previous_response_id"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
         "text", "invalid JSON schema"),
    ],
)  # fmt: skip
def test_bad_requests_are_400_naming_the_field(pie, body, param, words):
    headers = {"Authorization": "Bearer tok-alice"}  # a schema's check may import xgrammar (and torch) first
    got = httpx.post(f"{pie['url']}/v1/responses", json={"model": MODEL, **body}, headers=headers, timeout=120)
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and words in error["message"]


def test_a_background_response_answers_at_once_and_finishes_on_its_own(api):
    started = greedy(api, input="Tell me about paged attention.", background=True)
    assert started.background is True and started.status == "in_progress" and started.output == []
    for _ in range(120):
        done = api.responses.retrieve(started.id)
        if done.status != "in_progress":
            break
        time.sleep(0.25)
    assert done.status in ("completed", "incomplete") and done.background is True
    assert done.output_text == greedy(api, input="Tell me about paged attention.", store=False).output_text
    continued = greedy(api, input="Go on.", previous_response_id=done.id, background=True)
    for _ in range(120):
        again = api.responses.retrieve(continued.id)
        if again.status != "in_progress":
            break
        time.sleep(0.25)
    assert again.status in ("completed", "incomplete")
    assert again.usage.input_tokens_details.cached_tokens >= done.usage.input_tokens


def test_streaming_events_arrive_in_order_and_equal_the_whole_response(api):
    whole = greedy(api, input="Stream me a line.", max_output_tokens=12, store=False)
    events = list(greedy(api, input="Stream me a line.", max_output_tokens=12, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == whole.output_text == final.output_text
    assert final.output[0].id == events[2].item.id == events[-2].item.id


def test_a_function_tool_round_trip_continues_with_the_output(api):
    call_turn = greedy(api, input="Weather in Paris?", tools=[WEATHER], tool_choice="required", max_output_tokens=64)
    (call,) = call_turn.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) == {"city"}
    answer = greedy(
        api,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
        previous_response_id=call_turn.id,
        tools=[WEATHER],
        tool_choice="auto",  # the same tools: the stored context goes on (other tools would re-render it)
    )
    assert answer.output[0].type == "message" and answer.usage.input_tokens_details.cached_tokens > 0
    streamed = list(
        greedy(api, input="Weather?", tools=[WEATHER], tool_choice="required", max_output_tokens=64, stream=True)
    )
    kinds = [e.type for e in streamed]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    (item,) = streamed[-1].response.output
    assert item.type == "function_call" and set(json.loads(item.arguments)) == {"city"}


def test_a_forced_function_call_cut_by_the_token_limit_is_an_incomplete_function_call(api):
    """The issue's report, with the ``openai`` client: a forced call cut by ``max_output_tokens`` is a
    ``function_call`` item with the arguments so far, ``incomplete``; never its markup as output text."""
    tool = {**WEATHER, "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    forced = {"type": "function", "name": "get_weather"}
    whole = greedy(api, input="Weather in Oslo?", tools=[tool], tool_choice=forced, max_output_tokens=256)
    (call,) = whole.output
    (cut,) = greedy(
        api, input="Weather in Oslo?", tools=[tool], tool_choice=forced, max_output_tokens=whole.usage.output_tokens - 1
    ).output
    assert (cut.type, cut.name, cut.status) == ("function_call", "get_weather", "incomplete")
    assert call.arguments.replace(" ", "").startswith(cut.arguments.replace(" ", ""))
    assert call.status == whole.status  # "completed", unless 256 tokens cut even the whole one
    for choice in (forced, "required"):
        got = greedy(api, input="Weather in Oslo?", tools=[tool], tool_choice=choice, max_output_tokens=6)
        assert got.status == "incomplete" and "tool_call" not in got.output_text, got.output


def test_json_schema_text_format_parses_and_validates(api):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "adult": {"type": "boolean"}},
        "required": ["name", "adult"],
        "additionalProperties": False,
    }
    text = {"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}}
    got = greedy(api, input="A person as JSON.", text=text, max_output_tokens=64)
    person = json.loads(got.output_text)
    assert set(person) == {"name", "adult"} and isinstance(person["adult"], bool)
    assert got.text.format.type == "json_schema" and got.status == "completed"
    kw = {"model": MODEL, "input": "A person as JSON.", "text": text, "max_output_tokens": 64, "temperature": 0}
    with api.responses.stream(**kw) as stream:  # the client's helper, which accumulates the events itself
        assert stream.get_final_response().output_text == got.output_text


def test_an_openai_agents_sdk_agent_calls_its_function_tool_through_our_responses_api(pie):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from pydantic import BaseModel

    class Answer(BaseModel):  # a structured final answer: its grammar ends the turn, random weights or not
        weather: str = Field(max_length=12)

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=10)]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(base_url=f"{pie['url']}/v1", api_key="tok-alice", max_retries=0)
    agent = Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        output_type=Answer,
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=64),
    )
    result = asyncio.run(Runner.run(agent, "Weather in Paris?", max_turns=4, auto_previous_response_id=True))
    assert len(calls) == 1 and isinstance(calls[0], str)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    (first, *rest) = result.raw_responses
    assert rest and rest[0].usage.input_tokens_details.cached_tokens > 0  # continued the stored context
    assert isinstance(result.final_output, Answer)


def test_a_continuation_after_the_replica_died_recomputes_the_context_and_gives_the_same_tokens(pie, api, ray_cluster):
    from ray.util.state import list_actors

    first = greedy(api, input="Remember this.", max_output_tokens=6)
    time.sleep(PARK_S + 1)  # saved as a snapshot on the replica about to die
    unbroken = greedy(api, input="Go on.", previous_response_id=first.id)
    restarts = engine_status(pie)["replica_restarts"]
    (rank,) = list_actors(
        ray_cluster.address,
        filters=[("class_name", "=", "RankWorker"), ("state", "=", "ALIVE"), ("ray_namespace", "=", "pie")],
        detail=True,
    )
    os.kill(rank["pid"], signal.SIGKILL)
    for _ in range(240):
        status = engine_status(pie)
        if status["replica_restarts"] > restarts and all(r["state"] == "serving" for r in status["replicas"]):
            break
        time.sleep(0.5)
    again = greedy(api, input="Go on.", previous_response_id=first.id)
    assert again.output_text == unbroken.output_text
    assert again.usage.input_tokens_details.cached_tokens == unbroken.usage.input_tokens_details.cached_tokens


@pytest.mark.xfail(
    strict=False,
    reason="the ingress does not always learn of a closed stream through Serve's proxy before the turn ends: in one "
    "CI run the turn was still in progress 30 s after the client left (under investigation)",
)
def test_a_client_that_goes_away_mid_stream_leaves_a_failed_record_and_no_context(api, has_context):
    """The longest turn the tiny model allows takes a few seconds on a fast machine, and the ingress learns of the
    closed connection through Serve's proxy: a turn that completed first proves nothing either way, so the client
    tries again (a turn that completes is stored, as it should be)."""
    endless = {"max_output_tokens": 4000, "extra_body": {"ignore_eos": True}}
    statuses = []
    for _ in range(3):
        with api.responses.create(model=MODEL, input="Talk.", stream=True, **endless) as stream:
            response_id = next(iter(stream)).response.id
        for _ in range(60):  # the ingress notices the closed connection and aborts the turn
            if api.responses.retrieve(response_id).status != "in_progress":
                break
            time.sleep(0.5)
        statuses.append(api.responses.retrieve(response_id).status)
        if statuses[-1] != "completed":
            break
    assert statuses[-1] == "failed", statuses
    assert not has_context(response_id)


def test_stored_responses_survive_the_ingress_restarting(pie, api, ray_cluster, has_context):
    """One conversation saved as a snapshot continues from it; one whose program was parked in the killed ingress
    renders its stored history."""
    from ray.util.state import list_actors

    first = greedy(api, input="Keep this.")
    assert saved(first.id)
    second = greedy(api, input="Go on.", previous_response_id=first.id)
    parked_answer = greedy(api, input="More.", previous_response_id=second.id)
    assert parked_answer.usage.input_tokens_details.cached_tokens > second.usage.input_tokens
    (ingress,) = list_actors(
        ray_cluster.address,
        filters=[("class_name", "=", "ServeReplica:pie:PieIngress"), ("state", "=", "ALIVE")],
        detail=True,
    )
    os.kill(ingress["pid"], signal.SIGKILL)
    for _ in range(240):  # Serve starts a new replica of the ingress
        try:
            again = api.responses.retrieve(first.id)
            break
        except (openai.APIConnectionError, openai.InternalServerError, openai.APIStatusError):
            time.sleep(0.5)
    assert again.output_text == first.output_text
    continued = greedy(api, input="More.", previous_response_id=first.id)
    assert continued.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    rendered = greedy(api, input="More.", previous_response_id=second.id)
    assert rendered.usage.input_tokens_details.cached_tokens == 0
    assert rendered.output_text == resent(api, None, [("Keep this.", first), ("Go on.", second)], "More.")


def test_a_stored_turn_parks_with_its_context_live_then_saves_it_when_idle(api, has_context):
    """A continuation while the turn's program is parked prefills only its new input with nothing saved; a second
    branch from the same response renders the history; an idle one is saved, then continued from its snapshot."""
    first = greedy(api, input="Plan a trip.", instructions="Be brief.")
    second = greedy(api, input="Where to?", instructions="Be brief.", previous_response_id=first.id)
    assert second.usage.input_tokens_details.cached_tokens == first.usage.input_tokens + first.usage.output_tokens - 1
    assert not has_context(first.id)  # its context moved on to the second turn, live
    branch = greedy(api, input="Where to?", instructions="Be brief.", previous_response_id=first.id)
    assert branch.usage.input_tokens_details.cached_tokens == 0
    assert branch.output_text == resent(api, "Be brief.", [("Plan a trip.", first)], "Where to?")
    assert saved(second.id)
    third = greedy(api, input="When?", instructions="Be brief.", previous_response_id=second.id)
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens + second.usage.output_tokens - 1


def test_stored_responses_survive_the_response_store_restarting(pie, api, ray_cluster):
    """SIGKILL the response store: Ray restarts it with the records it wrote through to the GCS, so a stored
    response is retrieved and continued from its context as before."""
    from ray.util.state import list_actors

    first = greedy(api, input="Keep this one too.")
    filters = [("name", "=", "pie-responses"), ("state", "=", "ALIVE")]
    (store,) = list_actors(ray_cluster.address, filters=filters)
    os.kill(store["pid"], signal.SIGKILL)
    killed = time.monotonic()
    again = api.responses.retrieve(first.id)  # its call to the store is sent again to the restart
    print(f"a stored response was retrieved {time.monotonic() - killed:.1f} s after the store's SIGKILL")
    assert again.output_text == first.output_text
    continued = greedy(api, input="More.", previous_response_id=first.id)
    assert continued.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    (restarted,) = list_actors(ray_cluster.address, filters=filters)
    assert restarted["pid"] != store["pid"]


def test_an_idle_turn_releases_its_pages_and_still_continues_with_the_same_tokens(pie, api):
    first = greedy(api, input="Hold this.", max_output_tokens=40, extra_body={"ignore_eos": True})
    assert saved(first.id)  # continued from its snapshot, which stays
    resident = greedy(api, input="Go on.", previous_response_id=first.id)
    for _ in range(40):  # every turn idles: saved after PARK_S, then its pages are the replica's prefix cache
        time.sleep(0.5)
        (replica,) = engine_status(pie)["replicas"]
        if replica["pages_used"] == 0:
            break
    assert replica["pages_used"] == 0 and replica["pages_cached"] > 0, replica
    recomputed = greedy(api, input="Go on.", previous_response_id=first.id)
    assert recomputed.output_text == resident.output_text


@pytest.fixture(scope="module", autouse=True)
def short_lived(api, has_context) -> tuple[str, float]:
    """A stored response made as the module starts, saved and with its context: the expiry test near the module's
    end then waits out only what is left of its ``TTL_S``, not all of it."""
    stored = greedy(api, input="short lived")
    made = time.monotonic()
    assert saved(stored.id) and has_context(stored.id)
    return stored.id, made


def test_stored_responses_expire_with_their_context(api, has_context, short_lived):
    stored, made = short_lived
    time.sleep(max(0.0, made + TTL_S + 2 - time.monotonic()))
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(stored)
    with pytest.raises(openai.NotFoundError):
        greedy(api, input="more", previous_response_id=stored)
    assert not has_context(stored)
