"""Types that cross the boundary between inferlets, the replica engine and the model runner.

Pure Python + numpy (no torch), so the SDK can import it cheaply.
"""

from pie_workers.wire.batch import (
    ForwardBatch,
    ForwardRequest,
    RequestOutput,
    Slot,
    SlotKind,
    SlotOutput,
)
from pie_workers.wire.brle import BrleError

__all__ = [
    "BrleError",
    "ForwardBatch",
    "ForwardRequest",
    "RequestOutput",
    "Slot",
    "SlotKind",
    "SlotOutput",
]
