"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``, ``POST
/v1/responses/{id}/cancel``, with the chat routes' bearer tokens and error shapes.

Each turn runs the built-in program ``pie:openai-responses`` (``inferlet.responses``) as the calling user. A stored
response (``store``, the default) keeps its conversation as a KV snapshot named after it, and its record in the
cluster's response store (``stores.responses``), so ``previous_response_id`` continues the live context: only the
new input items are prefilled, on any replica, also after the ingress restarted. Another user's id is 404, as an
unknown one. A turn that fails, is cancelled or loses its client leaves no snapshot behind.

A stored turn's program parks in this process after answering (``ingress.responses.parked``): a continuation that lands
here is sent to it and prefills only its new input on the live context, with no launch and no snapshot; the
snapshot is saved when the conversation idles. A continuation whose context is neither parked here nor saved yet
(parked in another ingress replica, or in one that died, or a second branch from the same response) renders the
stored history instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import ray
from fastapi import APIRouter
from fastapi.responses import StreamingResponse
from inferlet.responses_schema import Continued, Parked, ResponsesRequest, Turn, snapshot_name
from pie_workers.deadlines import LAUNCHER_S, RESPONSE_STORE_S, NoAnswer, answer
from ray.exceptions import RayActorError

from pie_cluster.coalesced_calls import CoalescedCalls
from pie_cluster.config import ResponsesConfig
from pie_cluster.ingress.metrics import RequestClock
from pie_cluster.ingress.openai.checks import OpenAIError, check_grammars
from pie_cluster.ingress.openai.routes import OpenAIUser, Served, error_status
from pie_cluster.ingress.responses.objects import (
    ResponseStream,
    failed,
    finished,
    new_response_id,
    parse_turn,
    response_object,
)
from pie_cluster.ingress.responses.parked import ParkedConversations, ParkedTurn
from pie_cluster.ingress.routing import Prompt
from pie_cluster.launch_request import LaunchRequest
from pie_cluster.programs import RESPONSES_PROGRAM
from pie_cluster.stores.responses import RESPONSES, ResponseRecord

router = APIRouter(tags=["OpenAI Responses"])
RESPONSES_PATH = "/v1/responses"


class _Turn:
    """One turn being served: the request, its id and record (None when not stored)."""

    def __init__(self, user: str, request: ResponsesRequest, response_id: str):
        self.user, self.request, self.id = user, request, response_id
        self.record: ResponseRecord | None = None
        self.created_at = time.time()
        self.done = False
        self.parked: Served | None = None  # its program, parked after answering


class ResponsesRoutes:
    """Mixed into ``PieIngress`` beside ``OpenAIRoutes``, whose launch, events and model check it uses."""

    _namespace: str
    _store_handle = None
    _store_batches: dict[str, CoalescedCalls]
    _parked: ParkedConversations

    @router.post(RESPONSES_PATH)
    async def create_response(self, body: ResponsesRequest, user: OpenAIUser):
        await self._check_model(body.model)
        try:
            check_grammars(body.as_chat(body.items, {}))
        except ValueError as e:
            raise OpenAIError(400, str(e), param="text") from None
        except OpenAIError as e:  # the chat request's name for what is text.format here
            param = "text" if e.param == "response_format" else e.param
            raise OpenAIError(400, e.message.replace("response_format", "text.format"), param=param) from None
        response_id = new_response_id()
        parked = body.previous_response_id and self._parked.take(body.previous_response_id, user, body.header())
        if parked:
            turn, served = await self._continue_parked(parked, user, body, response_id)
        else:
            previous = await self._previous(user, body)
            served = await self._launch_turn(user, body, previous, response_id)
            turn = _Turn(user, body, response_id)
            turn.record = self._new_record(turn, served.instance)
            if turn.record is not None:  # not awaited: the store never lets it overwrite the finished record
                self._store().put.remote(turn.record)
        if body.stream:
            return StreamingResponse(self._streamed_turn(turn, served), media_type="text/event-stream")
        if body.background:
            self._in_background(self._background_turn(turn, served))
            return turn.record.body
        async with aclosing(self._turn_events(turn, served)) as events:
            async for kind, value in events:
                if kind == "return":
                    return await self._finish(turn, value)
                if kind == "error":
                    error = self._failure(turn, value)
                    self._failed_body(turn, error)
                    raise error
        raise OpenAIError(500, "the serving inferlet ended without an answer")

    @router.get(RESPONSES_PATH + "/{response_id}")
    async def get_response(self, response_id: str, user: OpenAIUser) -> dict:
        return (await self._record(user, response_id)).body

    @router.delete(RESPONSES_PATH + "/{response_id}")
    async def delete_response(self, response_id: str, user: OpenAIUser) -> dict:
        self._parked.discard(response_id, user)
        if await self._ask(self._store().delete.remote(user, response_id)) is None:
            raise self._unknown(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @router.post(RESPONSES_PATH + "/{response_id}/cancel")
    async def cancel_response(self, response_id: str, user: OpenAIUser) -> dict:
        record = await self._record(user, response_id)
        if record.status != "in_progress" or record.instance is None:
            raise OpenAIError(400, f"response {response_id} is {record.status}: only one in progress can be cancelled")
        try:
            await answer(self._launcher.abort.remote(user, record.instance), "the launcher", LAUNCHER_S)
        except (NoAnswer, RayActorError) as e:
            raise OpenAIError(503, f"the turn could not be cancelled: {e}") from None
        record.body |= {"status": "cancelled"}
        await self._ask(self._store().fail.remote(record))
        return record.body

    # -- serving a turn ----------------------------------------------------------------------------------------

    async def _previous(self, user: str, body: ResponsesRequest) -> ResponseRecord | None:
        """The finished response a continuation continues (None: it continues none)."""
        if body.previous_response_id is None:
            return None
        previous = await self._record(user, body.previous_response_id, param="previous_response_id")
        if previous.status not in ("completed", "incomplete"):
            message = f"previous_response_id {previous.id} is {previous.status}; only a finished one continues"
            raise OpenAIError(400, message, param="previous_response_id")
        return previous

    async def _launch_turn(
        self, user: str, body: ResponsesRequest, previous: ResponseRecord | None, response_id: str
    ) -> Served:
        """A new instance of the Responses program for the turn: continuing the saved context, or rendering the
        history (the header changed, or the context was never saved)."""
        continued, history = None, []
        if previous is not None and previous.header == body.header() and previous.saved:
            continued = Continued(
                snapshot=snapshot_name(previous.id), pending=previous.pending, call_names=previous.call_names
            )
        elif previous is not None:
            history = await self._ask(self._store().history.remote(user, previous.id))
        park = body.store and self._parked.park_s > 0
        program_input = Turn(request=body, response_id=response_id, continued=continued, history=history, park=park)
        launch = LaunchRequest(program=RESPONSES_PROGRAM, input=program_input.model_dump(mode="json", by_alias=True))
        # placed by instructions, history and items, and a continued context where the response it continues went
        # (its text is not here)
        items = [item.model_dump(mode="json", by_alias=True, exclude_none=True) for item in body.items]
        parts = [body.instructions or "", *history, *items]
        prompt = Prompt.of(body.model, parts, response_id, body.previous_response_id, body.cache_salt)
        return await self._start(user, launch, RequestClock("responses", body.model), named=False, prompt=prompt)

    async def _continue_parked(
        self, parked: ParkedTurn, user: str, body: ResponsesRequest, response_id: str
    ) -> tuple[_Turn, Served]:
        """The turn sent to the program parked after the response it continues, whose context is live with the
        closing tokens of that turn still buffered there. One call to the store checks that response and records
        this one in progress; a response gone meanwhile (deleted through another ingress, expired) ends the
        program and answers as for any unknown id."""
        turn = _Turn(user, body, response_id)
        turn.record = self._new_record(turn, parked.instance)
        previous = await self._asked(self._batched("begin_many")((user, parked.response_id, turn.record)))
        if previous is None or previous.status not in ("completed", "incomplete"):
            ParkedConversations.dismiss(parked.channel)
            if previous is None:
                raise self._unknown(parked.response_id, "previous_response_id")
            message = f"previous_response_id {previous.id} is {previous.status}; only a finished one continues"
            raise OpenAIError(400, message, param="previous_response_id")
        continued = Continued(snapshot=snapshot_name(previous.id), call_names=previous.call_names)
        program_input = Turn(request=body, response_id=response_id, continued=continued, park=body.store)
        parked.channel.put("message", program_input.model_dump_json(by_alias=True))
        clock = RequestClock("responses", body.model)
        clock.mark_admitted()
        return turn, Served(parked.user, parked.instance, parked.channel, clock, since=parked.since)

    @staticmethod
    def _new_record(turn: _Turn, instance: str) -> ResponseRecord | None:
        """A stored turn's record, in progress, served by ``instance`` (None: the request does not store it)."""
        body = turn.request
        if not body.store:
            return None
        items = [item.model_dump(mode="json", by_alias=True, exclude_none=True) for item in body.items]
        record = ResponseRecord(turn.id, turn.user, body.model, {}, body.previous_response_id, body.header(), items)
        record.instance, record.body = instance, response_object(body, turn.id, turn.created_at)
        return record

    def _init_responses(self, config: ResponsesConfig) -> None:
        """Called by the ingress's constructor."""
        self._parked = ParkedConversations(config.park_s, config.max_parked, self._saving)
        self._store_batches = {}
        self._background: set[asyncio.Task] = set()  # background turns, and saves of parked conversations

    def _saving(self, parked: ParkedTurn) -> None:
        """An idle conversation's program was told to save its snapshot: once it has, the record says so (a
        continuation anywhere then opens it)."""

        async def saved() -> None:
            if (await parked.channel.log.finished()).kind == "return":
                ref = self._store().saved.remote(parked.user, parked.model, parked.response_id)
                with contextlib.suppress(OpenAIError):  # the store is gone: the history renders it instead
                    await self._ask(ref)

        self._in_background(saved())

    async def _save_parked(self, within_s: float = 10.0) -> None:
        """Have every parked conversation saved (this ingress replica is stopping), waiting ``within_s`` at most
        for that and for the background turns."""
        self._parked.close()
        if self._background:
            await asyncio.wait(list(self._background), timeout=within_s)

    async def _background_turn(self, turn: _Turn, served: Served) -> None:
        """A background turn, finished with no client waiting: its record is what GET reads."""
        async with aclosing(self._turn_events(turn, served)) as events:
            async for kind, value in events:
                if kind == "return":
                    try:
                        await self._finish(turn, value)
                    except OpenAIError as e:  # the record is written failed, with this, by _turn_events
                        self._failed_body(turn, e)
                elif kind == "error":
                    self._failed_body(turn, self._failure(turn, value))

    def _in_background(self, work) -> None:
        """Run ``work`` on this process's loop, held until it ends (the loop keeps only weak references)."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _streamed_turn(self, turn: _Turn, served: Served) -> AsyncIterator[str]:
        stream = ResponseStream(turn.request, turn.id, turn.created_at)
        for line in stream.opening():
            yield line
        async with aclosing(self._turn_events(turn, served)) as events:
            async for kind, value in events:
                if kind == "message":
                    for line in stream.piece(value):
                        yield line
                elif kind == "return":
                    try:
                        report = parse_turn(value)
                        stream.adopt(report)
                        body = await self._finish(turn, value, report)
                        lines = stream.ending(report, body)
                    except OpenAIError as e:
                        lines = stream.failure(self._failed_body(turn, e))
                    for line in lines:
                        yield line
                elif kind == "error":
                    for line in stream.failure(self._failed_body(turn, self._failure(turn, value))):
                        yield line

    async def _finish(self, turn: _Turn, value: str, report=None) -> dict:
        """The finished response object; a stored one's record completed, with what continues it."""
        report = report or parse_turn(value)
        body = finished(turn.request, turn.id, turn.created_at, report)
        if turn.record is not None:
            record = turn.record
            record.body, record.pending, record.instance = body, report.pending, None
            record.call_names = {item.call_id: item.name for item in report.output if item.type == "function_call"}
            record.saved = turn.parked is None
            await self._asked(self._batched("put_many")(record))
        turn.done = True
        if turn.parked is not None:
            served, request = turn.parked, turn.request
            parked = ParkedTurn(
                turn.id, turn.user, request.model, request.header(), served.instance, served.channel, served.since
            )
            self._parked.park(parked)
        return body

    def _failure(self, turn: _Turn, message: str) -> OpenAIError:
        status = 404 if message.startswith("LookupError") else error_status(message)
        param = "previous_response_id" if status == 404 else None
        return OpenAIError(status, message, param=param)

    def _failed_body(self, turn: _Turn, error: OpenAIError) -> dict:
        """The failed response object, kept as the record's body when the turn is stored."""
        body = failed(turn.request, turn.id, turn.created_at, error)
        if turn.record is not None:
            turn.record.body = body
        return body

    async def _turn_events(self, turn: _Turn, served: Served) -> AsyncIterator[tuple[str, str]]:
        """The instance's events (closing early aborts it); a turn that did not finish leaves its record failed and
        no snapshot behind."""
        try:
            async with aclosing(self._events(served, _parks)) as events:
                async for kind, value in events:
                    if kind == "message" and _parks(value):
                        turn.parked = served
                        yield "return", Parked.model_validate_json(value).parked.model_dump_json()
                    else:
                        yield kind, value
        finally:
            if turn.parked is not None and not turn.done:
                ParkedConversations.dismiss(turn.parked.channel)
            if not turn.done and turn.record is not None:
                if turn.record.status == "in_progress":
                    self._failed_body(turn, OpenAIError(500, "the turn did not finish: its client went away"))
                self._store().fail.remote(turn.record)  # not awaited: this may run in a cancelled task

    async def _record(self, user: str, response_id: str, param: str | None = None) -> ResponseRecord:
        record = await self._ask(self._store().get.remote(user, response_id))
        if record is None:
            raise self._unknown(response_id, param)
        return record

    @staticmethod
    def _unknown(response_id: str, param: str | None = None) -> OpenAIError:
        return OpenAIError(404, f"no response with id {response_id!r}", param=param, code="response_not_found")

    async def _ask(self, ref):
        """The store's answer to a call; 503 when it does not answer in time or is gone."""
        return await self._asked(answer(ref, "the response store", RESPONSE_STORE_S))

    async def _asked(self, answered):
        try:
            return await answered
        except (NoAnswer, RayActorError) as e:
            raise OpenAIError(503, f"the response store is not reachable: {e}") from None

    def _batched(self, method: str) -> CoalescedCalls:
        """The store's batch ``method``, called once per event-loop turn for all the turns that call it then."""
        if method not in self._store_batches:
            self._store_batches[method] = CoalescedCalls(
                getattr(self._store(), method), "the response store", RESPONSE_STORE_S
            )
        return self._store_batches[method]

    def _store(self):
        """The cluster's response store (looked up on first use: it is the controller's, made after the app)."""
        if self._store_handle is None:
            self._store_handle = ray.get_actor(RESPONSES, namespace=self._namespace)
        return self._store_handle


def _parks(message: str) -> bool:
    """Whether a message of the Responses program is its ``Parked`` report (the others are streamed ``Piece``s)."""
    return message.startswith('{"parked":')
