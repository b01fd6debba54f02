"""The OpenAI-compatible routes: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``.

Each request runs as an inferlet instance of the requesting user — the built-in ``pie:openai-completions`` program,
or the uploaded program a request names in ``inferlet`` — so it goes through the same admission limits, KV-page
market and engine as any other inferlet, and prompts shared between requests reuse cached pages through the
replica's prefix trie. The built-in program runs in the ingress process itself (``ingress.own_programs``): the request
talks to the replica's socket and reads its events from memory, with one launcher call to admit it; with several
replicas of the model it goes to the one ``routing`` picks for its prompt (``[server] routing``). An OpenAI
``api_key`` is a Pie bearer token. Errors answer in OpenAI's shape (``checks.OpenAIError``). A client that
disconnects aborts its instance, so nothing it held stays behind.

The routes live in a mixin of the ingress deployment (``PieIngress``), on a router the app includes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Depends, Header, HTTPException
from fastapi.responses import StreamingResponse
from inferlet.openai_schema import ChatCompletionRequest, CompletionRequest
from pie_workers.deadlines import LAUNCHER_S, NoAnswer, answer
from ray import serve
from ray.exceptions import RayActorError, RayTaskError

from pie_cluster.hosts.events import TERMINAL, Channel, follow
from pie_cluster.ingress.errors import launcher_error
from pie_cluster.ingress.metrics import RequestClock, RequestMetrics
from pie_cluster.ingress.openai.chat_objects import Reply, error_event, parse_report
from pie_cluster.ingress.openai.checks import OpenAIError, check_grammars
from pie_cluster.ingress.own_programs import LocalInstances
from pie_cluster.ingress.routing import Prompt
from pie_cluster.launch_request import LaunchRequest
from pie_cluster.overloaded import Overloaded
from pie_cluster.programs import BUILTINS, OPENAI_PROGRAM

router = APIRouter(tags=["OpenAI-compatible"])
OPENAI_PATHS = ("/v1/models", "/v1/chat/completions", "/v1/completions")


async def openai_user(authorization: Annotated[str | None, Header()] = None) -> str:
    """The caller's user name; a missing or wrong key is 401 in OpenAI's shape, before the body is looked at."""
    try:
        return serve.get_replica_context().servable_object.user_for(authorization)
    except HTTPException as e:
        raise OpenAIError(e.status_code, str(e.detail), code="invalid_api_key", headers=e.headers) from None


OpenAIUser = Annotated[str, Depends(openai_user)]


def error_status(message: str) -> int:
    """An instance's error event as a status: what the request asked for that cannot be done is 400 (the
    inferlet raised ValueError or TypeError on it), anything else 500."""
    return 400 if message.startswith(("ValueError", "TypeError", "TokenBudgetExhausted")) else 500


@dataclass
class Served:
    """The instance serving one request: whose, its id, its channel when it runs in this process, its clock, and
    its first event that belongs to this request (a parked program serves several, one after the other)."""

    user: str
    instance: str
    channel: Channel | None
    clock: RequestClock
    since: int = 0


class OpenAIRoutes:
    """Mixed into ``PieIngress``, which provides ``_launcher``, ``_local`` (a ``LocalInstances``) and
    ``_request_metrics``."""

    _model_names: frozenset[str] = frozenset()
    _local: LocalInstances
    _request_metrics: RequestMetrics

    @router.get("/v1/models")
    async def list_models(self, user: OpenAIUser) -> dict:
        names = await self._served_models()
        return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "pie"} for n in sorted(names)]}

    @router.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, user: OpenAIUser):
        return await self._complete(user, body)

    @router.post("/v1/completions")
    async def completions(self, body: CompletionRequest, user: OpenAIUser):
        return await self._complete(user, body)

    async def _complete(self, user: str, body: ChatCompletionRequest | CompletionRequest):
        await self._check_model(body.model)
        check_grammars(body)
        launch = LaunchRequest(program=body.inferlet or OPENAI_PROGRAM, input=body.as_input())
        clock = RequestClock(body.api, body.model)
        served = await self._start(user, launch, clock, named=body.inferlet is not None, prompt=_prompt(body))
        reply = Reply(body.api, body.model, body.include_usage)
        if body.stream:
            return StreamingResponse(self._streamed(served, reply), media_type="text/event-stream")
        async with aclosing(self._events(served)) as events:
            async for kind, value in events:
                if kind == "return":
                    return reply.complete(parse_report(value))
                if kind == "error":
                    raise OpenAIError(error_status(value), value)
        raise OpenAIError(500, "the serving inferlet ended without an answer")

    async def _streamed(self, served: Served, reply: Reply) -> AsyncIterator[str]:
        """The response's SSE lines, those of one batch of events (what the program emitted in one loop turn, or
        what piled up while the client's connection was slower) written as one chunk."""
        async with aclosing(self._event_batches(served)) as batches:
            async for batch in batches:
                if text := "".join(line for kind, value in batch for line in self._stream_lines(reply, kind, value)):
                    yield text

    @staticmethod
    def _stream_lines(reply: Reply, kind: str, value: str) -> list[str]:
        if kind == "message":
            return reply.piece(value)
        if kind == "return":
            try:
                return reply.ending(parse_report(value))
            except OpenAIError as e:
                return [error_event(e.message, e.status)]
        if kind == "error":
            return [error_event(value, error_status(value))]
        return []

    async def _events(
        self, served: Served, ends_request: Callable[[str], bool] | None = None
    ) -> AsyncIterator[tuple[str, str]]:
        """``_event_batches``, one event at a time."""
        async with aclosing(self._event_batches(served, ends_request)) as batches:
            async for batch in batches:
                for event in batch:
                    yield event

    async def _event_batches(
        self, served: Served, ends_request: Callable[[str], bool] | None = None
    ) -> AsyncIterator[list[tuple[str, str]]]:
        """The instance's events as they come, until its terminal one, or (``ends_request``) a message that ends
        this request while the instance goes on. Closed before either (the client went away, and the handler or the
        stream was cancelled), it aborts the instance, which frees everything it holds. Its clock goes to the
        ingress's histograms at the end."""
        channel, clock = served.channel, served.clock
        followed = follow(
            self._launcher,
            served.user,
            served.instance,
            served.since,
            abort_on_close=channel is None,
            channel=channel,
        )
        answered, first = False, served.since == 0  # a parked program's later requests have no start of their own
        try:
            async with aclosing(followed) as batches:
                async for events in batches:
                    batch = []
                    for index, kind, value in events:
                        answered = kind == "message" and ends_request is not None and ends_request(value)
                        if kind == "message" and not answered:
                            clock.mark_token()
                        elif kind in TERMINAL or answered:
                            clock.mark_ended()
                        batch.append((kind, value))
                        if answered:
                            served.since = index + 1  # before the yield: the consumer may park it at once
                            break
                    if batch:
                        yield batch
                    if answered:
                        return
        finally:
            if channel is not None:
                if first:
                    clock.started, clock.first_pass = channel.started, channel.first_pass
                if not channel.log.done and not answered:
                    self._local.abort(served.instance, "its client went away")
            self._request_metrics.observe(clock)

    async def _start(
        self, user: str, launch: LaunchRequest, clock: RequestClock, named: bool, prompt: Prompt | None = None
    ) -> Served:
        """The instance serving this request: the cluster's own programs run here (with their channel, on the
        replica picked for ``prompt``), uploaded ones on a node's host (its events are read there)."""
        try:
            if launch.program in BUILTINS:
                started = await self._local.start(user, launch.program, launch.input, prompt)
                if started is not None:
                    clock.mark_admitted()
                    return Served(user, *started, clock)
            launched = await answer(self._launcher.launch.remote(user, launch), "the launcher", LAUNCHER_S)
            clock.mark_admitted()
            return Served(user, launched, None, clock)
        except NoAnswer as e:
            raise OpenAIError(503, str(e)) from None
        except (RayTaskError, Overloaded, ValueError) as e:  # the last two: this request's own admission answer
            http = launcher_error(e.cause if isinstance(e, RayTaskError) else e)
            param = "inferlet" if named and http.status_code == 404 else None
            raise OpenAIError(http.status_code, str(http.detail), param=param, headers=http.headers) from None
        except RayActorError:
            raise OpenAIError(503, "the launcher is not reachable; is the cluster running?") from None

    async def _check_model(self, model: str) -> None:
        """404 in OpenAI's shape for a model this cluster does not serve."""
        if model not in self._model_names and model not in await self._served_models():
            message = f"the model {model!r} does not exist; this cluster serves: {', '.join(self._model_names)}"
            raise OpenAIError(404, message, param="model", code="model_not_found")

    async def _served_models(self) -> frozenset[str]:
        """The model names, asked of the launcher again when a request names one not known yet."""
        try:
            self._model_names = frozenset(await answer(self._launcher.models.remote(), "the launcher", LAUNCHER_S))
        except (RayTaskError, RayActorError, NoAnswer):
            raise OpenAIError(503, "the cluster's models are not reachable; is the cluster running?") from None
        return self._model_names


def _prompt(body: ChatCompletionRequest | CompletionRequest) -> Prompt:
    """The request's prompt as the router keys it: the messages in order, or the prompts."""
    if isinstance(body, ChatCompletionRequest):
        messages = [m.model_dump(mode="json", exclude_none=True) for m in body.messages]
        return Prompt.of(body.model, messages, cache_salt=body.cache_salt)
    return Prompt.of(body.model, body.prompts, cache_salt=body.cache_salt)
