"""GPU side of one model replica: model code, paged KV pool, batch execution, tensor parallelism.

Only `pie_workers.wire` (pure Python, no torch) may be imported by the SDK; everything else is replica internals.
"""
