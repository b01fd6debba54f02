"""The replica engine in this process, over a real runner, with its batch scheduler running, driven as the channel
drives it: for tests of the engine's pass machinery (chained steps, steps run ahead); or serving its channel on a
loop of its own (``serving``), for tests that talk to it over real sockets."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable

from pie_workers.engine.scheduler import BatchLimits
from pie_workers.engine.service import ReplicaEngine
from pie_workers.runner import ModelRunner
from pie_workers.wire.batch import Slot, SlotKind
from pie_workers.wire.codec import slot_to_wire
from pie_workers.wire.messages import PassKind, PassReply, PassRequest, decode, encode
from support.sdk_host import TRUST

# a seeded draw: reproducible, and unlike greedy decoding the tiny random model's tokens do not settle into a loop
SAMPLER = slot_to_wire(Slot(SlotKind.MULTINOMIAL, temperature=1.0, seed=1234))
PAGES = 64
SESSION = f"{TRUST.instance('alice', 'run')['capability']}/s"  # capability/session: how the channel names a sender
PROMPT = [random.Random(7).randrange(3, 4000) for _ in range(29)]


class Engine:
    def __init__(self, runner: ModelRunner):
        self.engine = ReplicaEngine(runner, BatchLimits(), secret=TRUST.secret)
        self.batches = asyncio.get_running_loop().create_task(self.engine.scheduler.run())

    async def call(self, op: str, *args):
        return await self.engine._handle(SESSION, op, list(args), None)

    def forward(
        self, ctx: int, tokens, position: int, *, chained=None, steps=1, hold=0, sampler=SAMPLER, ahead=None, slots=None
    ):
        """Send a pass sampling its last row (or with the given ``slots``); a future of its answer as
        (slots, walk, seq_len, next drafts), or None for a chained pass that stopped before running."""
        future = asyncio.get_running_loop().create_future()

        def answer(error, result):
            future.set_exception(error) if error else future.set_result(_unpacked(result))

        rows = max(len(tokens), 1)
        request = PassRequest(
            ctx,
            kind=PassKind.INPUT if chained is None else PassKind.CHAINED,
            tokens=tokens,
            positions=list(range(position, position + rows)),
            slots=[[rows - 1, sampler]] if slots is None else slots,
            hold=hold,
            steps=steps,
            stop_ids=chained if chained is not None else ahead if ahead is not None else [],
            run_ahead=ahead is not None,
        )
        self.engine._handle(SESSION, "forward", [encode(request)], answer)
        return future

    async def prefilled(self, prompt: list[int]) -> tuple[int, int]:
        """A context holding ``prompt``, whose last pass sampled a token; returns (context, that token)."""
        ctx = await self.call("create")
        [slots, _, _, _] = await self.forward(ctx, prompt, 0)
        return ctx, slots[0][1]

    def stop(self) -> None:
        self.batches.cancel()


def _unpacked(answer: dict | None) -> tuple | None:
    if answer is None:
        return None
    reply = decode(PassReply, answer)
    return reply.slots, reply.walk, reply.seq_len, reply.next_drafts


def run(runner: ModelRunner, body):
    """Run ``body(engine)`` on a fresh engine over ``runner``; returns what it returns."""

    async def main():
        engine = Engine(runner)
        try:
            return await body(engine)
        finally:
            engine.stop()

    return asyncio.run(main())


def serving(make_engine: Callable[[], ReplicaEngine]) -> tuple[str, ReplicaEngine, asyncio.AbstractEventLoop]:
    """An engine (made on its own loop, in a daemon thread) serving its channel: its ipc path, itself, its loop."""
    bound: list = []

    async def main():
        engine = make_engine()
        bound.append((engine.start("127.0.0.1")["ipc_path"], engine, asyncio.get_running_loop()))
        await asyncio.Event().wait()

    threading.Thread(target=asyncio.run, args=(main(),), daemon=True).start()
    while not bound:
        threading.Event().wait(0.01)
    return bound[0]
