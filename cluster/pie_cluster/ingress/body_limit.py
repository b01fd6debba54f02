"""Every request body is read at most to a limit, whatever the route: an ingress replica, which every user's
requests share, never holds more of one body than that.

Past the limit (or when ``Content-Length`` declares more), reading the body raises ``HTTPException(413)``, which
the app's handler answers in the route's error shape after authentication (``app._too_large``). FastAPI's own
``max_body_size`` answers a declared oversize with Starlette's plain-text 413 in place of the handler's response,
which neither an OpenAI client nor ours can read as an error.
"""

from fastapi import HTTPException
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimit:
    def __init__(self, app: ASGIApp, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length", "")
        too_large = declared.isdigit() and int(declared) > self.limit
        received = 0

        async def limited() -> Message:
            nonlocal received
            if too_large:
                raise HTTPException(413)
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise HTTPException(413)
            return message

        await self.app(scope, limited, send)
