"""What the OpenAI routes check beyond the request's own validation, and the errors they answer in OpenAI's shape.

The request itself is ``inferlet.openai_schema``'s: the same models validate the body here and are read back by the
program that serves it.
"""

from __future__ import annotations

import json

from inferlet.openai_schema import ChatCompletionRequest, CompletionRequest


class OpenAIError(Exception):
    """An error to answer in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None, headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    @property
    def type(self) -> str:
        return {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(
            self.status, "rate_limit_error" if self.status == 429 else "server_error"
        )

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _grammar_checks(request: ChatCompletionRequest | CompletionRequest) -> list[tuple[str, dict]]:
    """(param, schema) pairs the grammar compiler must accept before anything is launched."""
    if not isinstance(request, ChatCompletionRequest):
        return []
    checks = []
    if request.response_format is not None and request.response_format.json_schema is not None:
        checks.append(("response_format", request.response_format.json_schema.schema_))
    if request.forced_tools:
        checks += [("tools", t.function.parameters) for t in request.tools or []]
    return checks


def check_grammars(request: ChatCompletionRequest | CompletionRequest) -> None:
    """Refuse, with 400 naming the field, a JSON schema the grammar compiler cannot build (before a launch)."""
    checks = _grammar_checks(request)
    if checks:
        import xgrammar  # only here: it imports torch, which the ingress otherwise never needs
    for param, schema in checks:
        try:
            xgrammar.Grammar.from_json_schema(json.dumps(schema))
        except Exception as e:  # xgrammar raises RuntimeError (and others) with the compiler's reason
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise OpenAIError(400, f"{param}: invalid JSON schema: {reason}", param=param) from None
