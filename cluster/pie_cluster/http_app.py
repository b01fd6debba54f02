"""The HTTP launch endpoint: a FastAPI app served by Ray Serve in front of the launcher.

Every route but ``/healthz`` and ``/metrics`` needs ``Authorization: Bearer <token>``; the token names the user
(``[auth.tokens]`` in config.toml). With auth explicitly off, every caller is the user ``local``. Users only ever
see their own instances: another user's id answers 404, exactly like an id that does not exist.

Events stream as Server-Sent Events: ``id`` is the event's index (resume with ``?since=``), ``event`` its kind,
``data`` a JSON string (files are base64). The stream ends after the terminal ``return`` or ``error`` event.
``POST /v1/instances?stream=true`` launches and answers with the stream itself, opened by a ``launched`` event
(no ``id``) whose data is the instance id: one request instead of two, for clients that wait on the outcome.
"""

import base64
import json
from typing import Annotated, Any

import ray
from fastapi import FastAPI, Header, HTTPException, Query, Request, Response
from fastapi.responses import StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field
from ray import serve

from pie_cluster.config import AuthConfig
from pie_cluster.launcher import NotFound
from pie_cluster.programs import ProgramError

LOCAL_USER = "local"

app = FastAPI(title="Pie on Ray", description="Launch inferlets and follow their events.", version="0.1.0")


class LaunchRequest(BaseModel):
    program: str = Field(description="program id returned by POST /v1/programs")
    input: dict[str, Any] = Field(default_factory=dict, description="the inferlet's input object")
    deadline_s: float | None = Field(None, gt=0, description="abort the instance after this many seconds")
    node_id: str | None = Field(None, description="run on this Ray node (default: near the models, least busy)")
    token_budget: int | None = Field(
        None,
        ge=0,
        description="tokens the instance may spend on the KV-page market: it is endowed with one credit per page "
        "of them (default: the cluster's default endowment)",
    )


class Launched(BaseModel):
    id: str


class Uploaded(BaseModel):
    program: str
    name: str
    isolated: bool


class SessionMessage(BaseModel):
    message: str


class Instance(BaseModel):
    id: str
    program: str
    status: str
    node: str
    input: dict[str, Any]
    created: float
    elapsed_s: float


def _wire_value(kind: str, value: str | bytes) -> str:
    return base64.b64encode(value).decode() if kind == "file" else value


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class PieIngress:
    def __init__(self, auth: AuthConfig, namespace: str):
        self._auth = auth
        self._launcher = ray.get_actor("pie-launcher", namespace=namespace)
        self._registry = CollectorRegistry()
        self._requests = Counter("pie_http_requests", "HTTP requests by route", ["route"], registry=self._registry)
        self._launches = Counter("pie_launches", "inferlet instances launched over HTTP", registry=self._registry)
        self._running = Gauge("pie_instances_running", "instances running cluster-wide", registry=self._registry)

    def _user(self, authorization: str | None) -> str:
        if not self._auth.enabled:
            return LOCAL_USER
        scheme, _, token = (authorization or "").partition(" ")
        user = self._auth.tokens.get(token) if scheme.lower() == "bearer" else None
        if user is None:
            raise HTTPException(401, "missing or unknown bearer token", headers={"WWW-Authenticate": "Bearer"})
        return user

    async def _call(self, route: str, method, *args):
        """One launcher call, its errors mapped to HTTP: unknown ids 404, bad input 400."""
        self._requests.labels(route).inc()
        try:
            return await method.remote(*args)
        except NotFound as e:
            raise HTTPException(404, str(e)) from None
        except (ProgramError, ValueError) as e:
            raise HTTPException(400, str(e)) from None

    @app.get("/healthz")
    async def health(self) -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(self) -> Response:
        self._running.set((await self._launcher.stats.remote())["running"])
        return Response(generate_latest(self._registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/programs", response_model=Uploaded)
    async def upload(
        self,
        request: Request,
        filename: Annotated[str, Query(description="program.py, or a .zip of a directory with pie.toml")],
        authorization: Annotated[str | None, Header()] = None,
    ) -> dict:
        user = self._user(authorization)
        return await self._call("upload", self._launcher.upload, user, filename, await request.body())

    @app.post(
        "/v1/instances",
        response_model=Launched,
        responses={200: {"content": {"text/event-stream": {}}, "description": "with ?stream=true: the events"}},
    )
    async def launch(
        self,
        body: LaunchRequest,
        stream: Annotated[bool, Query(description="answer with the instance's event stream (SSE)")] = False,
        authorization: Annotated[str | None, Header()] = None,
    ):
        user = self._user(authorization)
        launcher = self._launcher
        instance = await self._call(
            "launch", launcher.launch, user, body.program, body.input, body.deadline_s, body.node_id, body.token_budget
        )
        self._launches.inc()
        if stream:
            opening = f"event: launched\ndata: {json.dumps(instance)}\n\n"
            events = self._stream(user, instance, 0, opening=opening)
            return StreamingResponse(events, media_type="text/event-stream")
        return {"id": instance}

    @app.get("/v1/instances", response_model=list[Instance])
    async def list_instances(self, authorization: Annotated[str | None, Header()] = None) -> list:
        return await self._call("list", self._launcher.list, self._user(authorization))

    @app.get("/v1/instances/{instance_id}/events")
    async def events(
        self,
        instance_id: str,
        since: int = 0,
        authorization: Annotated[str | None, Header()] = None,
    ) -> StreamingResponse:
        user = self._user(authorization)
        first = await self._call("events", self._launcher.events, user, instance_id, since, 0.0)  # 404s here
        return StreamingResponse(self._stream(user, instance_id, since, first), media_type="text/event-stream")

    async def _stream(self, user: str, instance_id: str, since: int, batch: dict | None = None, opening: str = ""):
        """SSE text: ``opening``, then the events from ``since`` on (``batch``: the first ones, already fetched)."""
        if opening:
            yield opening
        while True:
            if batch is None:
                batch = await self._launcher.events.remote(user, instance_id, since, 10.0)
                if not batch["events"] and not batch["done"]:
                    yield ": keep-alive\n\n"
            for index, kind, value in batch["events"]:
                yield f"id: {index}\nevent: {kind}\ndata: {json.dumps(_wire_value(kind, value))}\n\n"
            if batch["done"]:
                return
            since, batch = batch["next"], None

    @app.post("/v1/instances/{instance_id}/messages", status_code=204)
    async def send(
        self, instance_id: str, body: SessionMessage, authorization: Annotated[str | None, Header()] = None
    ) -> None:
        await self._call("send", self._launcher.send, self._user(authorization), instance_id, body.message)

    @app.post("/v1/instances/{instance_id}/files", status_code=204)
    async def send_file(
        self, instance_id: str, request: Request, authorization: Annotated[str | None, Header()] = None
    ) -> None:
        user = self._user(authorization)
        await self._call("send_file", self._launcher.send_file, user, instance_id, await request.body())

    @app.delete("/v1/instances/{instance_id}")
    async def abort(self, instance_id: str, authorization: Annotated[str | None, Header()] = None) -> dict:
        aborted = await self._call("abort", self._launcher.abort, self._user(authorization), instance_id)
        return {"aborted": aborted}


def serve_http(auth: AuthConfig, namespace: str, host: str, port: int, max_ongoing_requests: int) -> str:
    """Deploy the app on Ray Serve (proxy on the head node); returns its base URL."""
    serve.start(http_options={"host": host, "port": port, "location": "HeadOnly"})
    deployment = PieIngress.options(max_ongoing_requests=max_ongoing_requests)
    serve.run(deployment.bind(auth, namespace), name="pie", route_prefix="/", blocking=False)
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"


def stop_http() -> None:
    serve.delete("pie")
