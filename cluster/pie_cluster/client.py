"""A Python client of the HTTP launch endpoint (what ``pie submit/list/attach/abort`` use)."""

from __future__ import annotations

import base64
import io
import json
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from pie_cluster.launch_request import LaunchRequest


class PieClientError(RuntimeError):
    """The endpoint refused a request; the message is its explanation."""


def package(path: str | Path) -> tuple[str, bytes]:
    """What to upload for a program path: a .py file as is, a directory as a zip (it must hold pie.toml)."""
    path = Path(path)
    if path.is_file():
        return path.name, path.read_bytes()
    if not path.is_dir():
        raise PieClientError(f"{path}: no such program file or directory")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as archive:
        for file in sorted(path.rglob("*")):
            if file.is_file() and "__pycache__" not in file.parts:
                archive.write(file, str(file.relative_to(path)))
    return f"{path.name}.zip", buf.getvalue()


class PieClient:
    def __init__(self, url: str, token: str | None = None, timeout: float = 30.0):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def _check(self, response: httpx.Response) -> httpx.Response:
        if response.is_error:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise PieClientError(f"{response.status_code}: {detail}")
        return response

    def upload(self, path: str | Path) -> dict:
        filename, data = package(path)
        return self._check(self._http.post("/v1/programs", params={"filename": filename}, content=data)).json()

    def launch(self, request: LaunchRequest) -> str:
        return self._check(self._http.post("/v1/instances", json=_wire(request))).json()["id"]

    def launch_and_follow(self, request: LaunchRequest) -> Iterator[tuple[int, str, Any]]:
        """Launch and follow in one request: ``(-1, "launched", instance_id)``, then the instance's events (as
        ``events`` yields them) until its terminal one."""
        body = _wire(request)
        with self._http.stream("POST", "/v1/instances", params={"stream": "true"}, json=body, timeout=None) as response:
            yield from self._sse(response)

    def events(self, instance_id: str, since: int = 0) -> Iterator[tuple[int, str, Any]]:
        """Follow the instance's Server-Sent Events until its terminal event: (index, kind, value)."""
        path = f"/v1/instances/{instance_id}/events"
        with self._http.stream("GET", path, params={"since": since}, timeout=None) as response:
            yield from self._sse(response)

    def _sse(self, response: httpx.Response) -> Iterator[tuple[int, str, Any]]:
        if response.is_error:
            response.read()
            self._check(response)
        fields: dict[str, str] = {}
        for line in response.iter_lines():
            if line.startswith(":"):
                continue
            if line:
                key, _, value = line.partition(": ")
                fields[key] = value
                continue
            if "event" in fields:
                kind, value = fields["event"], json.loads(fields["data"])
                index = int(fields["id"]) if "id" in fields else -1
                yield index, kind, base64.b64decode(value) if kind == "file" else value
            fields = {}

    def send(self, instance_id: str, message: str) -> None:
        self._check(self._http.post(f"/v1/instances/{instance_id}/messages", json={"message": message}))

    def send_file(self, instance_id: str, data: bytes) -> None:
        self._check(self._http.post(f"/v1/instances/{instance_id}/files", content=data))

    def abort(self, instance_id: str) -> bool:
        return self._check(self._http.delete(f"/v1/instances/{instance_id}")).json()["aborted"]

    def list(self) -> list[dict]:
        return self._check(self._http.get("/v1/instances")).json()

    def resolve(self, prefix: str) -> str:
        """The full id of the caller's instance starting with ``prefix`` (as Pie's attach/abort match ids)."""
        matches = [i["id"] for i in self.list() if i["id"].startswith(prefix)]
        if len(matches) != 1:
            found = "no instance" if not matches else f"{len(matches)} instances ({', '.join(m[:8] for m in matches)})"
            raise PieClientError(f"{found} of yours matches {prefix!r}")
        return matches[0]


def _wire(request: LaunchRequest) -> dict:
    """The request as the endpoint's JSON body (unset fields left to the cluster's defaults)."""
    return request.model_dump(exclude_none=True)
