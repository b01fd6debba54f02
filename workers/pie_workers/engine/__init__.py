"""The replica engine: page and context bookkeeping, and the batch scheduler that feeds the model runner."""

from pie_workers.engine.contexts import ContextError, ContextTable, TableStats
from pie_workers.engine.holding import ContextView, PageCopies
from pie_workers.engine.page_store import Node, OutOfPages, PageStats, PageStore, page_key

__all__ = [
    "ContextError",
    "ContextTable",
    "ContextView",
    "Node",
    "OutOfPages",
    "PageCopies",
    "PageStats",
    "PageStore",
    "TableStats",
    "page_key",
]
