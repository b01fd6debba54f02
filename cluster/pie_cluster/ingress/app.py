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
import logging
import time
from contextlib import aclosing
from typing import Annotated

import ray
from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pie_workers.deadlines import HOST_S, LAUNCHER_S, NoAnswer, answer
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.schema import ProxyStatus

from pie_cluster.config import AuthConfig, CacheConfig, ResponsesConfig, ServerConfig
from pie_cluster.hosts.events import TERMINAL, Location, NotFound, follow
from pie_cluster.ingress.body_limit import BodyLimit
from pie_cluster.ingress.errors import launcher_error
from pie_cluster.ingress.metrics import RequestClock, RequestMetrics, ScalingGauges
from pie_cluster.ingress.openai.checks import OpenAIError
from pie_cluster.ingress.openai.routes import OPENAI_PATHS, OpenAIRoutes
from pie_cluster.ingress.openai.routes import router as openai_router
from pie_cluster.ingress.own_programs import LocalInstances
from pie_cluster.ingress.recent_hosts import RecentHosts
from pie_cluster.ingress.responses.routes import RESPONSES_PATH, ResponsesRoutes
from pie_cluster.ingress.responses.routes import router as responses_router
from pie_cluster.ingress.routing import PrefixRouter
from pie_cluster.launch_request import LaunchRequest, describe_errors
from pie_cluster.launcher.records import ListedInstance, Uploaded
from pie_cluster.programs import BUILTINS
from pie_cluster.programs.program import MAX_PROGRAM_BYTES
from pie_cluster.ray_session import CONTROLLER

LOCAL_USER = "local"
log = logging.getLogger("pie.http")

# Every request's body: uploads and files are the largest (a program's limit); JSON bodies are far smaller, and none
# is held in an ingress replica's memory past this
MAX_BODY_BYTES = MAX_PROGRAM_BYTES
app = FastAPI(title="Pie on Ray", description="Launch inferlets and follow their events.", version="0.1.0")
app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)


def _ingress() -> "PieIngress":
    """The deployment instance serving this request (Serve runs one per replica process)."""
    return serve.get_replica_context().servable_object


async def authenticated_user(authorization: Annotated[str | None, Header()] = None) -> str:
    """The caller's user name. A dependency, so FastAPI checks it before it validates the body: a request with no
    token gets 401 whatever else is wrong with it, and learns nothing of the schema."""
    return _ingress().user_for(authorization)


User = Annotated[str, Depends(authenticated_user)]


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status, headers=headers)


def _openai_error(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


@app.exception_handler(OpenAIError)
async def _openai_failure(request: Request, error: OpenAIError) -> JSONResponse:
    return _openai_error(error)


def _refusal(request: Request, status: int, message: str, param: str | None = None) -> JSONResponse:
    """An error found before the route's dependencies ran (the body is read first), answered after authentication
    all the same: without a valid token it is 401, and the caller learns nothing of the schema or the limits. On
    the OpenAI routes in OpenAI's shape."""
    openai = request.url.path in OPENAI_PATHS or request.url.path.startswith(RESPONSES_PATH)
    try:
        _ingress().user_for(request.headers.get("authorization"))
    except HTTPException as e:
        if openai:
            return _openai_error(OpenAIError(e.status_code, e.detail, code="invalid_api_key", headers=e.headers))
        return _error(e.status_code, e.detail, e.headers)
    if openai:
        return _openai_error(OpenAIError(status, message, param=param))
    return _error(status, message)


@app.exception_handler(RequestValidationError)
async def _invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
    """Malformed bodies and out-of-range fields are 400 with one line naming the fields (``param``: the first)."""
    fields = [str(p) for p in (error.errors() or [{}])[0].get("loc", ()) if p != "body"]
    return _refusal(request, 400, describe_errors(error.errors()), fields[0] if fields else None)


@app.exception_handler(413)
async def _too_large(request: Request, error: HTTPException) -> JSONResponse:
    """A body past ``MAX_BODY_BYTES`` (``body_limit.py``: checked as it is read, never buffered beyond it)."""
    return _refusal(request, 413, f"the request body is over the limit of {MAX_BODY_BYTES >> 20} MiB")


@app.middleware("http")
async def _no_tracebacks(request: Request, call_next):
    """An unexpected failure answers 500 with one line; the traceback goes to the ingress' log, never to clients
    (it names processes, nodes and source paths)."""
    try:
        return await call_next(request)
    except Exception:
        log.exception("unhandled error serving %s %s", request.method, request.url.path)
        return _error(500, "internal error serving this request; the cluster's log has the details")


class Launched(BaseModel):
    id: str


class SessionMessage(BaseModel):
    message: str


def _wire_value(kind: str, value: str | bytes) -> str:
    return base64.b64encode(value).decode() if kind == "file" else value


app.include_router(openai_router)
app.include_router(responses_router)


# Helpers above this line: Serve freezes (pickles) the app's routes when the class is decorated, so what they
# call must already be defined.
@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class PieIngress(OpenAIRoutes, ResponsesRoutes):
    def __init__(
        self,
        auth: AuthConfig,
        namespace: str,
        routing: str = "prefix",
        responses: ResponsesConfig | None = None,
        shared_prefixes: bool = False,
    ):
        self._auth, self._namespace = auth, namespace
        self._launcher = ray.get_actor("pie-launcher", namespace=namespace)
        self._registry = CollectorRegistry()
        router = PrefixRouter(routing, shared_prefixes=shared_prefixes)
        self._local = LocalInstances(self._launcher, BUILTINS, router)
        self._init_responses(responses or ResponsesConfig())
        self._requests = Counter("pie_http_requests", "HTTP requests by route", ["route"], registry=self._registry)
        self._launches = Counter("pie_launches", "inferlet instances launched over HTTP", registry=self._registry)
        self._running = Gauge("pie_instances_running", "instances running cluster-wide", registry=self._registry)
        self._scaling = ScalingGauges(self._registry)
        self._controller = None  # found on the first /metrics (it starts after this app)
        self._hosts = RecentHosts()  # where the session messages of a user's instance went last
        self._request_metrics = RequestMetrics(self._registry)

    async def __del__(self) -> None:
        """Serve is stopping this replica: the conversations parked here are saved as snapshots first, so another
        replica continues them from there rather than rendering their history again."""
        await self._save_parked()

    def user_for(self, authorization: str | None) -> str:
        if not self._auth.enabled:
            return LOCAL_USER
        scheme, _, token = (authorization or "").partition(" ")
        user = self._auth.tokens.get(token) if scheme.lower() == "bearer" else None
        if user is None:
            raise HTTPException(401, "missing or unknown bearer token", headers={"WWW-Authenticate": "Bearer"})
        return user

    async def _call(self, route: str | None, method, *args, part: str = "the launcher", deadline: float = LAUNCHER_S):
        """One call to the launcher (or an inferlet host: ``part``), its errors mapped to HTTP with the message
        alone (Ray wraps an actor's exception in a RayTaskError whose text is a whole traceback): unknown ids 404,
        bad input 400, a part that is down or not ready 503. ``route``: the request to count (None: counted)."""
        if route is not None:
            self._requests.labels(route).inc()
        try:
            return await answer(method.remote(*args), part, deadline)
        except RayTaskError as e:
            raise launcher_error(e.cause) from None
        except NoAnswer as e:
            raise HTTPException(503, str(e)) from None
        except RayActorError:
            raise HTTPException(503, f"{part} is not reachable; is the cluster running?") from None

    @app.get("/healthz")
    async def health(self) -> dict:
        """Up, and how uploaded programs are confined (``off``: they run trusted, with Ray in reach)."""
        return {"status": "ok", "sandbox": (await self._call("healthz", self._launcher.stats)).sandbox}

    @app.get("/metrics")
    async def metrics(self) -> Response:
        self._running.set((await self._call("metrics", self._launcher.stats)).running)
        try:
            self._controller = self._controller or ray.get_actor(CONTROLLER, namespace=self._namespace)
            self._scaling.set(await answer(self._controller.scaling.remote(), "the controller", LAUNCHER_S))
        except (ValueError, NoAnswer, RayActorError):  # the controller restarting: the last values stand
            pass
        return Response(generate_latest(self._registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/programs", response_model=Uploaded)
    async def upload(
        self,
        request: Request,
        user: User,
        filename: Annotated[
            str, Query(max_length=255, description="program.py, or a .zip of a directory with pie.toml")
        ],
    ) -> Uploaded:
        data = await request.body()
        return await self._call("upload", self._launcher.upload, user, filename, data)

    @app.post(
        "/v1/instances",
        response_model=Launched,
        responses={200: {"content": {"text/event-stream": {}}, "description": "with ?stream=true: the events"}},
    )
    async def launch(
        self,
        body: LaunchRequest,
        user: User,
        stream: Annotated[bool, Query(description="answer with the instance's event stream (SSE)")] = False,
    ):
        clock = RequestClock("instances", "-")
        instance = await self._call("launch", self._launcher.launch, user, body)
        clock.mark_admitted()
        self._launches.inc()
        if stream:
            opening = f"event: launched\ndata: {json.dumps(instance)}\n\n"
            events = self._stream(user, instance, 0, opening=opening, clock=clock)
            return StreamingResponse(events, media_type="text/event-stream")
        return {"id": instance}

    @app.get("/v1/instances", response_model=list[ListedInstance])
    async def list_instances(self, user: User) -> list[ListedInstance]:
        return await self._call("list", self._launcher.list, user)

    @app.get("/v1/instances/{instance_id}/events")
    async def events(
        self,
        instance_id: str,
        user: User,
        since: Annotated[int, Query(ge=0, description="resume after the event with this id")] = 0,
    ) -> StreamingResponse:
        where = await self._call("events", self._launcher.locate, user, instance_id, 0.0)  # 404s here
        return StreamingResponse(self._stream(user, instance_id, since, where), media_type="text/event-stream")

    async def _stream(
        self,
        user: str,
        instance_id: str,
        since: int,
        where: Location | None = None,
        opening: str = "",
        clock: RequestClock | None = None,
    ):
        """SSE text: ``opening``, then the events from ``since`` on, read from where the instance runs (``where``:
        the launcher's answer to ``locate``, already asked). ``clock``: the launch's, for the histograms (its
        "first token" is the first event)."""
        if opening:
            yield opening
        followed = follow(self._launcher, user, instance_id, since, wait=10.0, where=where)
        try:
            async with aclosing(followed) as batches:
                async for events in batches:
                    if not events:
                        yield ": keep-alive\n\n"
                    for index, kind, value in events:
                        if clock is not None:
                            clock.mark_token()
                            if kind in TERMINAL:
                                clock.mark_ended()
                        yield f"id: {index}\nevent: {kind}\ndata: {json.dumps(_wire_value(kind, value))}\n\n"
        finally:
            if clock is not None:
                self._request_metrics.observe(clock)

    @app.post("/v1/instances/{instance_id}/messages", status_code=204)
    async def send(self, instance_id: str, body: SessionMessage, user: User) -> None:
        await self._deliver("send", user, instance_id, "message", body.message)

    @app.post("/v1/instances/{instance_id}/files", status_code=204)
    async def send_file(self, instance_id: str, request: Request, user: User) -> None:
        data = await request.body()
        await self._deliver("send_file", user, instance_id, "file", data)

    async def _deliver(self, route: str, user: str, instance_id: str, kind: str, value: str | bytes) -> None:
        """Into the instance's inbox on the host that runs it (waiting a while for a queued one to start). The host
        that took the user's last message to the instance takes the next one without asking the launcher (the host
        checks whose instance it is); one that no longer runs it, or is gone, sends the message the launcher's way."""
        self._requests.labels(route).inc()
        key = (user, instance_id)
        if (host := self._hosts.get(key)) is not None:
            try:
                return await answer(host.send.remote(user, instance_id, kind, value), "its inferlet host", LAUNCHER_S)
            except RayTaskError as e:  # a full inbox is an answer; not running it (any more) sends us to the launcher
                if not isinstance(e.cause, NotFound | ValueError):
                    raise launcher_error(e.cause) from None
            except NoAnswer as e:  # it may yet deliver this one: not sent twice
                raise HTTPException(503, str(e)) from None
            except RayActorError:  # its host is gone
                pass
            self._hosts.forget(key)
        where = await self._call(None, self._launcher.locate, user, instance_id, HOST_S, deadline=2 * LAUNCHER_S)
        if where.ending is not None:
            raise HTTPException(400, f"instance {instance_id} has ended; it can no longer receive")
        if where.host is None:
            raise HTTPException(503, "the instance is still waiting for admission; send it again once it runs")
        await self._call(None, where.host.send, user, instance_id, kind, value, part="its inferlet host")
        self._hosts.remember(key, where.host)

    @app.delete("/v1/instances/{instance_id}")
    async def abort(self, instance_id: str, user: User) -> dict:
        aborted = await self._call("abort", self._launcher.abort, user, instance_id)
        return {"aborted": aborted}


PROXY_START_S = 180.0  # for Serve's HTTP proxy to be up, however many times Serve restarts it meanwhile


def start_proxy(server: ServerConfig) -> None:
    """Serve's controller and HTTP proxy (on the head node), which need nothing of Pie's services: `pie start` brings
    them up while the models load. Idempotent.

    Serve kills a proxy that is not ready within its ready-check timeout and starts another, but ``serve.start``
    waits on the first one and raises when it dies. On a loaded head (a worker process took 17 s to start in CI)
    that happens, so the proxy Serve started in its place is waited for instead."""
    try:
        serve.start(http_options={"host": server.host, "port": server.port, "location": "HeadOnly"})
    except RayActorError:
        deadline = time.monotonic() + PROXY_START_S
        while (states := set(serve.status().proxies.values())) != {ProxyStatus.HEALTHY}:
            if time.monotonic() > deadline:
                raise TimeoutError(f"Serve's HTTP proxy was not up after {PROXY_START_S:.0f} s: {states}") from None
            time.sleep(0.5)


def serve_http(
    auth: AuthConfig,
    namespace: str,
    server: ServerConfig,
    responses: ResponsesConfig | None = None,
    cache: CacheConfig | None = None,
) -> str:
    """Deploy the app on Ray Serve (proxy on the head node) with ``server``'s replicas; returns its base URL.
    ``cache``: whose prefixes the replicas share, which the ingress places requests by."""
    start_proxy(server)
    deployment = PieIngress.options(**server.deployment_options())
    shared = (cache or CacheConfig()).share == "cluster"
    bound = deployment.bind(auth, namespace, server.routing, responses or ResponsesConfig(), shared)
    serve.run(bound, name="pie", route_prefix="/", blocking=False)
    host = "127.0.0.1" if server.host in ("0.0.0.0", "::") else server.host
    return f"http://{host}:{server.port}"


def stop_http() -> None:
    """Remove the app; and Serve itself when no other application uses it, so that its HTTP proxy lets go of the
    port (the next `pie start` may ask for another one, which a running proxy would ignore)."""
    serve.delete("pie")
    if not serve.status().applications:
        serve.shutdown()
