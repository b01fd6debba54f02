"""The OpenAI-compatible routes on a `pie start`ed cluster, driven by the official `openai` client (sync, async and
streaming) and by raw HTTP for the SSE framing and the error shapes.

The tiny model has random weights, so its text is gibberish; what is checked is the protocol and the semantics:
greedy output equal to an inferlet's own greedy run, streamed equal to non-streamed, alone equal to among 32,
seeds reproducible, stop strings cut, JSON that parses and validates, forced tool calls, logprobs that are
log-probabilities. One module of ~410 lines on purpose: its tests share one started cluster, whose start
costs ~30 CPU-seconds.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import textwrap
import time

import httpx
import openai
import pytest
from inferlet.openai_schema import ChatCompletionRequest, CompletionRequest, read_request
from pie_cluster.client import PieClient
from pie_cluster.ingress.openai.chat_objects import parse_report
from pie_cluster.ingress.openai.checks import OpenAIError
from pie_cluster.launch_request import LaunchRequest
from pydantic import ValidationError
from support.paths import ROOT
from support.pie_procs import PIE, engine_status, started_pie

MODEL = "default"


@pytest.fixture(scope="module")
def pie(ray_cluster, tmp_path_factory):
    yield from started_pie(ray_cluster, tmp_path_factory.mktemp("pie-openai"))


def chat(api, content="Tell me about paged attention.", **kw):
    return api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def test_models_lists_the_served_model_and_a_wrong_key_is_401_in_openai_shape(pie, api):
    assert [m.id for m in api.models.list().data] == [MODEL]
    bad = openai.OpenAI(base_url=f"{pie['url']}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
    raw = httpx.post(f"{pie['url']}/v1/chat/completions", content=b"{not json")
    assert raw.status_code == 401 and set(raw.json()["error"]) == {"message", "type", "param", "code"}


def test_greedy_chat_equals_an_inferlets_own_greedy_run_and_reports_usage(pie, api, tmp_path):
    got = chat(api, max_tokens=12, temperature=0)
    choice = got.choices[0]
    assert got.object == "chat.completion" and got.model == MODEL and choice.index == 0
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert got.usage.completion_tokens <= 12 and got.usage.prompt_tokens > 5
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    # The same conversation through the SDK directly, as a user's inferlet.
    program = textwrap.dedent("""
        from inferlet import Context, Model, Sampler

        async def main(input):
            model = Model.load("default")
            with Context(model) as ctx:
                ctx.user("Tell me about paged attention.")
                return await ctx.generate(Sampler.argmax(), max_tokens=12).collect_text()
    """)
    (tmp_path / "own_greedy.py").write_text(program)
    client = PieClient(pie["url"], "tok-alice")
    uploaded = client.upload(tmp_path / "own_greedy.py")
    events = list(client.launch_and_follow(LaunchRequest(program=uploaded["program"])))
    assert events[-1][1:] == ("return", choice.message.content)


def test_streamed_chat_equals_non_streamed_and_ends_with_usage(api):
    whole = chat(api, max_tokens=16, temperature=0).choices[0]
    chunks = list(chat(api, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == whole.message.content and finishes == [whole.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert len({c.id for c in chunks}) == 1


def test_completions_prompts_echo_n_and_max_tokens(api):
    got = api.completions.create(model=MODEL, prompt=["Once upon", "The cat"], max_tokens=5, n=2, temperature=0)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert got.choices[0].text == got.choices[1].text  # greedy: both choices of a prompt agree
    assert all(c.finish_reason in ("stop", "length") for c in got.choices)
    echoed = api.completions.create(model=MODEL, prompt="Once upon", max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == "Once upon" + got.choices[0].text
    fixed = api.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert fixed.usage.completion_tokens == 7 and fixed.choices[0].finish_reason == "length"


def test_seeds_reproduce_and_choices_differ(api):
    kw = {"max_tokens": 12, "temperature": 1.0, "seed": 42, "n": 3, "extra_body": {"ignore_eos": True}}
    first, second = chat(api, **kw), chat(api, **kw)
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in second.choices]
    assert len(set(texts)) > 1  # each choice draws its own randomness from the seed
    filtered = {"max_tokens": 8, "temperature": 0.8, "top_p": 0.9, "seed": 7, "extra_body": {"top_k": 20}}
    assert chat(api, **filtered).choices[0].message.content == chat(api, **filtered).choices[0].message.content
    assert chat(api, max_tokens=4, temperature=0.9, seed=3, extra_body={"min_p": 0.1}).choices[0].finish_reason in (
        "stop",
        "length",
    )


def test_stop_strings_cut_the_text_and_are_not_returned(api):
    base = (
        api.completions.create(
            model=MODEL, prompt="Once upon", max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = base[5:8]
    assert len(stop) == 3
    for stream in (False, True):
        got = api.completions.create(
            model=MODEL, prompt="Once upon", max_tokens=24, temperature=0, stop=[stop, "never-there"], stream=stream
        )
        if stream:
            chunks = list(got)
            text = "".join(c.choices[0].text for c in chunks)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason][0]
        else:
            text, reason = got.choices[0].text, got.choices[0].finish_reason
        assert text == base[: base.index(stop)] and reason == "stop"


def test_json_schema_and_json_object_outputs_parse_and_validate(api):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "adult": {"type": "boolean"}},
        "required": ["name", "adult"],
        "additionalProperties": False,
    }
    got = chat(
        api,
        "Give me a person as JSON.",
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    ).choices[0]
    person = json.loads(got.message.content)
    assert set(person) == {"name", "adult"} and isinstance(person["adult"], bool) and got.finish_reason == "stop"
    anything = chat(api, max_tokens=48, temperature=0.7, seed=5, response_format={"type": "json_object"})
    if anything.choices[0].finish_reason == "stop":
        json.loads(anything.choices[0].message.content)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
        },
    },
}


def test_forced_tool_calls_are_parsed_into_tool_calls(api):
    for choice, parallel in (("required", True), ({"type": "function", "function": {"name": "get_weather"}}, False)):
        got = chat(
            api, "Weather in Paris?", max_tokens=64, temperature=0, tools=[WEATHER], tool_choice=choice,
            parallel_tool_calls=parallel,
        )  # fmt: skip
        message = got.choices[0].message
        assert got.choices[0].finish_reason == "tool_calls" and message.content is None
        (call,) = message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        assert set(json.loads(call.function.arguments)) == {"city"}
    streamed = list(
        chat(api, "Weather?", max_tokens=64, temperature=0, tools=[WEATHER], tool_choice="required", stream=True)
    )
    calls = [t for c in streamed if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert [c.function.name for c in calls] == ["get_weather"]
    assert [c.choices[0].finish_reason for c in streamed if c.choices[0].finish_reason] == ["tool_calls"]


OPEN_WEATHER = {  # as a new user writes it: nothing bounds the city's length
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _squeezed(json_text: str) -> str:
    return json_text.replace(" ", "")


def test_a_forced_tool_call_cut_by_the_token_limit_is_a_partial_call_never_markup(api):
    """Cut at each of several token limits short of the whole call, the reply is a partial ``tool_calls`` entry
    (its arguments a prefix of the whole call's) with ``finish_reason`` "length", or, cut before the name is whole,
    no call; its markup is never the message's content."""
    forced = {"type": "function", "function": {"name": "get_weather"}}
    whole = chat(api, "Weather in Oslo?", max_tokens=256, temperature=0, tools=[OPEN_WEATHER], tool_choice=forced)
    (call,) = whole.choices[0].message.tool_calls
    needed = whole.usage.completion_tokens
    partial_calls = 0
    for limit in sorted({needed - 1, needed - 3, needed // 2, 4} - {0}, reverse=True):
        got = chat(api, "Weather in Oslo?", max_tokens=limit, temperature=0, tools=[OPEN_WEATHER], tool_choice=forced)
        choice = got.choices[0]
        assert choice.finish_reason == "length" and not choice.message.content, (limit, choice)
        for cut in choice.message.tool_calls or []:
            partial_calls += 1
            assert cut.function.name == "get_weather" and _squeezed(call.function.arguments).startswith(
                _squeezed(cut.function.arguments)
            )  # (the whole call's arguments are re-encoded; a cut one is the text written so far)
    assert partial_calls >= 1  # the limit one short of the whole call cuts it after its name


def test_a_conversation_with_tool_results_and_text_parts_continues(api):
    messages = [
        {"role": "system", "content": "You call tools."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    got = api.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=8, temperature=0
    )
    assert got.choices[0].message.tool_calls is None and got.usage.prompt_tokens > 30


def test_logprobs_are_log_probabilities_of_the_chosen_tokens(api):
    got = chat(api, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    entries = got.choices[0].logprobs.content
    assert len(entries) == 6
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5)  # greedy took the most likely
        assert sum(math.exp(t.logprob) for t in e.top_logprobs) <= 1 + 1e-5
    completion = api.completions.create(
        model=MODEL,
        prompt="Once upon",
        max_tokens=4,
        temperature=0.8,
        seed=1,
        logprobs=2,
        extra_body={"ignore_eos": True},
    ).choices[0]
    assert len(completion.logprobs.tokens) == 4 and all(len(t) <= 2 for t in completion.logprobs.top_logprobs)
    assert "".join(completion.logprobs.tokens) == completion.text


def test_32_concurrent_async_requests_equal_the_same_requests_alone(pie, api):
    prompts = [f"Request number {i} asks about caching." for i in range(32)]
    alone = [chat(api, p, max_tokens=10, temperature=0).choices[0].message.content for p in prompts[:4]]

    async def together():
        client = openai.AsyncOpenAI(base_url=f"{pie['url']}/v1", api_key="tok-alice", max_retries=0, timeout=300)
        got = await asyncio.gather(
            *(
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=10, temperature=0
                )
                for p in prompts
            )
        )
        await client.close()
        return [g.choices[0].message.content for g in got]

    assert asyncio.run(together())[:4] == alone
    # each request's wallet, opened while the launcher admitted it, is closed and its pages paid for
    deadline = time.monotonic() + 60
    while (market := engine_status(pie)["market"])["wallets"] != 0:
        assert time.monotonic() < deadline, market
        time.sleep(0.5)
    assert market["balanced"]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
        ({"model": MODEL, "messages": []}, 400, "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, "max_tokens"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -0.5}, 400, "temperature"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5},
            400,
            "presence_penalty",
        ),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                "stream_options": {"continuous_usage_stats": True},
            },
            400,
            "stream_options",
        ),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"1": 2}}, 400, "logit_bias"),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                },
            },
            400,
            "response_format",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "inferlet": "no-such-program"},
            404,
            "inferlet",
        ),
    ],
)
def test_bad_requests_get_openai_errors_naming_the_field(pie, body, status, param):
    got = httpx.post(f"{pie['url']}/v1/chat/completions", json=body, headers={"Authorization": "Bearer tok-alice"})
    assert got.status_code == status, got.text
    error = got.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert "Traceback" not in error["message"] and param in error["message"] or status == 404


def test_raw_sse_framing(pie):
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 3, "stream": True, "temperature": 0}
    with httpx.stream(
        "POST", f"{pie['url']}/v1/completions", json=body, headers={"Authorization": "Bearer tok-alice"}
    ) as got:
        assert got.status_code == 200 and got.headers["content-type"].startswith("text/event-stream")
        raw = "".join(got.iter_text())
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_request_can_name_an_uploaded_program_that_serves_it(pie, api):
    """Best-of-4 behind the unchanged client: `pie upload` gives the id, ``inferlet`` names it; one choice comes
    back, its usage counts every candidate, and streaming gives the same text."""
    env = {**pie["env"], "PIE_URL": pie["url"], "PIE_TOKEN": "tok-alice"}
    uploaded = subprocess.run(
        [*PIE, "upload", str(ROOT / "examples" / "openai_best_of_n.py")], env=env, capture_output=True, text=True
    )
    assert uploaded.returncode == 0, uploaded.stderr
    program = uploaded.stdout.strip()
    kw = {"max_tokens": 8, "temperature": 0.9, "seed": 11, "extra_body": {"inferlet": program, "ignore_eos": True}}
    got = chat(api, **kw)
    assert len(got.choices) == 1 and got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 4 * 8
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(api, stream=True, **kw) if c.choices)
    assert streamed == got.choices[0].message.content


def test_a_client_that_goes_away_aborts_its_request_and_frees_its_pages(pie):
    """A streamed request asking for thousands of tokens, dropped after its first chunks: its inferlet is aborted,
    and the replica holds no context or page of it afterwards."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Go on forever."}], "max_tokens": 100000}
    body |= {"stream": True, "ignore_eos": True, "temperature": 0}
    headers = {"Authorization": "Bearer tok-bob"}
    with httpx.stream("POST", f"{pie['url']}/v1/chat/completions", json=body, headers=headers, timeout=60) as got:
        lines = got.iter_lines()
        assert [next(lines) for _ in range(6)]  # the first chunks arrived: it is generating
    deadline = time.time() + 60
    while time.time() < deadline:
        (instance,) = httpx.get(f"{pie['url']}/v1/instances", headers=headers).json()
        if instance["status"] != "running":
            break
        time.sleep(0.5)
    assert instance["status"] == "failed"
    (replica,) = engine_status(pie)["replicas"]
    assert replica["contexts"] == 0 and replica["pages_used"] == 0


def test_the_program_reads_the_record_the_route_validated_and_unknown_fields_are_errors():
    """One record from the route to the serving program: what the route validated reads back equal, and a field
    neither side defines is an error in the program's input and in the report the route reads, never dropped."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    body |= {"tools": [tool], "tool_choice": "required", "stop": "x", "logprobs": True, "top_logprobs": 2}
    request = ChatCompletionRequest.model_validate(body)
    assert read_request(request.as_input()) == request
    assert (request.stops, request.alternatives, request.token_limit) == (["x"], 2, 1024)
    assert read_request(CompletionRequest(model=MODEL, prompt="x").as_input()).prompts == ["x"]
    with pytest.raises(ValidationError, match="stray"):
        read_request({**request.as_input(), "stray": 1})
    with pytest.raises(OpenAIError) as refused:
        parse_report(json.dumps({"choices": [{"index": 0, "txt": "a typo"}]}))
    assert refused.value.status == 502
