"""What the launcher raised, as the HTTP error to answer: its message, never its traceback."""

import logging
import math

from fastapi import HTTPException
from pydantic import ValidationError

from pie_cluster.hosts.events import NotFound
from pie_cluster.launch_request import describe_errors
from pie_cluster.overloaded import Overloaded

log = logging.getLogger("pie.http")


def launcher_error(cause: BaseException | None) -> HTTPException:
    """The HTTP answer for what the launcher raised: its message, never its traceback; a full cluster is 429 with
    the seconds to wait in ``Retry-After``, and so is an instance's full inbox."""
    if isinstance(cause, Overloaded):  # the launcher's queues, an instance's inbox (InboxFull)
        retry = str(max(1, math.ceil(cause.retry_after_s)))
        return HTTPException(429, str(cause), headers={"Retry-After": retry})
    if isinstance(cause, NotFound):
        return HTTPException(404, str(cause.args[0]) if cause.args else "not found")
    if isinstance(cause, ValidationError):
        return HTTPException(400, describe_errors(cause.errors()))
    if isinstance(cause, ValueError):  # ProgramError included
        return HTTPException(400, str(cause))
    if isinstance(cause, RuntimeError | TimeoutError):  # it cannot serve now (no hosts yet), or a part hangs
        return HTTPException(503, str(cause))
    log.error("launcher call failed: %r", cause)
    return HTTPException(500, "internal error serving this request; the cluster's log has the details")
