"""``Generator``: the multi-step decode loop over a context — sampling, stop conditions, manual stepping.

The collectors' chained passes and the stepping loop share one per-generation state (buffer, counters, stop set,
constraints), read and written at every step; that is why they stay one class in one file past 400 lines.

Each step runs the context's buffer (the prompt on the first step, then the previous token) with the auto sampler
on its last row, folds the sampled token into the state, and decides whether to stop: ``max_tokens`` reached, a
token of the stop set (the chat template's end-of-turn tokens plus any you add; never replacing them), or
``accept``-ed tokens doing either. The token that ends a turn is not kept; ``ctx.seal()`` closes the turn.
Probe indices count from the step's output row: 0 is the row that predicts the next token.

Constraints (``constrain=``, ``.constrain()``, ``logit_mask=``) AND their masks into the one logit mask each step
sends. Grammar constraints allow the template's end-of-turn tokens only where the grammar is complete, so with the
default stop set generation ends there (the stop token is not kept). Whatever the stop set, a constraint that has
terminated ends generation too: the step after it would have nothing to sample.

Speculation (``speculator=`` or ``system_speculation=True``) sends drafts with each step; the replica verifies them in
the same pass and writes the accepted ones' KV, so a step may produce several tokens. Tokens are exactly those of
generation without drafts: drafts are cut to what ``max_tokens`` leaves room for and to what the constraints allow,
and each draft is verified under the constraints' mask after the drafts before it. When a stop token or
``max_tokens`` cuts inside the accepted drafts, the tokens past the cut are truncated from the KV again, so KV,
``seq_len`` and the buffer end exactly as a run without drafts leaves them.

The collectors (``collect_tokens``, ``collect_text``) hand no step to user code, so when nothing else needs a step's
token before the next step can go — no constraint, no speculation — they let the replica run up to 16 steps per
pass, each on the token the step before sampled (a *chained* pass, ending at a stop token), and send the next such
pass before the previous one's output is back. The inferlet's round trip then overlaps the replica's batches instead
of adding to them, and the replica's bookkeeping per step is a fraction of a pass's. Tokens, KV, ``seq_len`` and the
buffer end exactly as with stepping one by one, also when a collector returns early or is cancelled.

Stepping with ``async for`` needs each step's token in user code, so each step is a round trip; but a plain step
(auto sampler, no constraint or speculation, more than one token left) asks the replica to run the next step
*ahead*, on the token it sampled, while its answer travels. If the next step is exactly that step (the user appended
nothing, cleared no sampler and added no probe), the replica answers it from the step run ahead; otherwise that step
is dropped and never reaches the KV.

Each step also bids for the context's pages on the KV-page market (``scheduling.default_bid`` from the balance and
the tokens still expected), unless the inferlet set a bid itself or the context is idle; the bid rides with the
step's forward.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pie_workers.wire.pages import pages_for

from inferlet import chat, scheduling
from inferlet.adapter import Adapter, check_zo_seed
from inferlet.constraints import AnyJson, Constraint, ConstraintSet, JsonSchema, Schema
from inferlet.forward import Forward, Output, ProbeHandle, SampleHandle
from inferlet.sampler import Probe, Sampler
from inferlet.spec import Speculator

if TYPE_CHECKING:
    from inferlet.context import Context

SYSTEM_DRAFTS = 4  # n-gram drafts asked of the replica per step with system_speculation
CHAIN_STEPS = 16  # steps a collector asks of one chained pass


@dataclass
class _Sent:
    """A collector's step in flight: its pass, the auto sampler's handle, the reply to come, and its input."""

    fwd: Forward
    auto: SampleHandle
    reply: asyncio.Future
    fed: list[int] | None  # its input; for a chained pass None until the token it feeds is known here
    steps: int  # steps the replica runs at most (each one input token)
    end: int  # the position after its last step's input


class GenStep:
    def __init__(self, gen: Generator):
        self._gen = gen
        self._cleared = False
        self._every_step = list(gen._step_probes)  # slots: these probes, then this step's, then the sampler
        self._probes: list[tuple[int, Probe]] = []
        self._executed = False

    def clear_sampler(self) -> GenStep:
        """Drop the auto sampler: the pass still runs; read a probe and ``g.accept([...])`` your own token."""
        self._cleared = True
        return self

    def probe(self, idx: int, probe: Probe) -> ProbeHandle:
        """Attach a probe for this step only; its handle indexes this step's output."""
        self._probes.append((idx, probe))
        return ProbeHandle(len(self._every_step) + len(self._probes) - 1, probe.kind)

    async def execute(self) -> Output:
        if self._executed:
            raise ValueError("this generation step was already executed")
        self._executed = True
        return await self._gen._run_step(self)


class Generator:
    def __init__(
        self,
        ctx: Context,
        sampler: Sampler,
        *,
        max_tokens: int | None = None,
        stop: list[int] | None = None,
        constrain: Schema | Constraint | list[Schema | Constraint] | None = None,
        logit_mask: list[int] | None = None,
        speculator=None,
        system_speculation: bool = False,
        adapter=None,
        zo_seed: int | None = None,
        horizon: int | None = None,
        auto_flush: bool = True,
    ):
        if speculator is not None and system_speculation:
            raise ValueError("speculator and system_speculation are mutually exclusive: pass one of them")
        if speculator is not None and not isinstance(speculator, Speculator):
            raise TypeError(
                f"speculator= needs draft/accept/rollback/reset methods (inferlet.spec.Speculator), "
                f"got {type(speculator).__name__}"
            )
        if not isinstance(sampler, Sampler):
            raise TypeError(f"generate() needs a Sampler, got {type(sampler).__name__}")
        if max_tokens is not None and max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        ctx._check_live()
        self._ctx = ctx
        self._sampler = sampler
        self._max_tokens = max_tokens
        self._constraints = ConstraintSet(ctx.model)
        if logit_mask:
            self._constraints.add_mask(logit_mask)
        if constrain is not None:
            self._constraints.add(constrain)
        self._horizon = horizon
        self._bid_basis: dict | None = None  # the market readings the latest default bid was made from
        self._adapter: Adapter | None = None
        self._zo_seed: int | None = None
        if adapter is not None:
            self.adapter(adapter)
        if zo_seed is not None:
            self.zo_seed(zo_seed)
        if auto_flush:
            ctx.cue()
            self._stop = set(chat.stop_tokens(ctx.model)) | set(stop or [])
        else:
            self._stop = set(stop or [])
        self._step_probes: list[tuple[int, Probe]] = []
        self._generated = 0
        self._done = False
        self._speculator: Speculator | None = speculator
        self._system_speculation = system_speculation
        self._system_drafts: list[int] = []  # the replica's n-gram drafts for the next step

    # -- builder -------------------------------------------------------------------------------------------------

    def max_tokens(self, n: int) -> Generator:
        self._max_tokens = n
        return self

    def stop(self, tokens: list[int]) -> Generator:
        """Replace the stop set."""
        self._stop = set(tokens)
        return self

    def add_stop(self, tokens: list[int]) -> Generator:
        self._stop |= set(tokens)
        return self

    def horizon(self, n: int) -> Generator:
        """Hint at the expected output length (used by the credit market's bidding)."""
        self._horizon = n
        return self

    def constrain(self, c: Schema | Constraint | list[Schema | Constraint]) -> Generator:
        """Add a constraint (or a list); it composes with those already attached and applies from the next step."""
        self._constraints.add(c)
        return self

    def adapter(self, a: Adapter) -> Generator:
        """Apply a LoRA adapter on every step (the prompt's included, if it has not been flushed)."""
        if not isinstance(a, Adapter):
            raise TypeError(f"adapter() needs an Adapter, got {type(a).__name__}")
        self._adapter = a
        return self

    def zo_seed(self, seed: int) -> Generator:
        """Perturb the adapter by this Evolution Strategies seed on every step."""
        self._zo_seed = check_zo_seed(seed)
        return self

    def probe_each_step(self, idx: int, probe: Probe) -> ProbeHandle:
        """Attach a probe to every step; the handle is valid on each step's output."""
        self._step_probes.append((idx, probe))
        return ProbeHandle(len(self._step_probes) - 1, probe.kind)

    # -- state ---------------------------------------------------------------------------------------------------

    @property
    def tokens_generated(self) -> int:
        return self._generated

    @property
    def is_done(self) -> bool:
        return self._done or (self._max_tokens is not None and self._generated >= self._max_tokens)

    # -- stepping ------------------------------------------------------------------------------------------------

    def __aiter__(self) -> Generator:
        return self

    async def __anext__(self) -> GenStep:
        if self.is_done:
            raise StopAsyncIteration
        return GenStep(self)

    async def _run_step(self, step: GenStep) -> Output:
        ctx = self._ctx
        pending = ctx.buffer()
        if not pending:
            self._done = True
            return Output([])
        mask = self._constraints.step_mask()
        fwd = Forward(ctx)
        fwd.input(pending)
        if self._adapter is not None:
            fwd.adapter(self._adapter)
        if self._zo_seed is not None:
            fwd.zo_seed(self._zo_seed)
        last = len(pending) - 1
        for idx, probe in step._every_step + step._probes:
            fwd.probe(last + idx, probe)
        auto: SampleHandle | None = None if step._cleared else fwd.sample([last], self._sampler)
        if mask is not None:
            fwd.mask(mask)
        proposed = self._draft(fwd) if auto is not None else 0
        if self._system_speculation and auto is not None:
            fwd._draft_budget = SYSTEM_DRAFTS
        elif auto is not None and mask is None and not fwd._drafts and self._more_than_one_left():
            fwd._ahead = sorted(self._stop)  # the replica runs the next step while this one's answer travels
        ctx._buffer = []
        bid = await self._default_bid()
        if bid is not None and bid != ctx._bid:
            fwd._bid = ctx._bid = bid  # rides in the forward request, set before its pages are reserved
        try:
            out = await fwd.execute()
        except BaseException:
            ctx._buffer = pending  # nothing reached the KV cache
            raise
        out.auto_sampler = auto
        if auto is not None:
            self._system_drafts = fwd._next_drafts
            walk = fwd._walk if fwd._drafts else [out.token(auto)]
            out.tokens, surplus = self._fold(walk, in_kv=len(walk) - 1)
            if surplus:  # a stop or max_tokens cut inside the accepted drafts: their KV goes too
                ctx._seq_len = await ctx.model.channel.call("truncate", ctx._id, surplus)
            if self._speculator is not None:
                self._speculator.accept(out.tokens)
                if proposed > len(walk) - 1:
                    self._speculator.rollback(proposed - (len(walk) - 1))
        return out

    def _more_than_one_left(self) -> bool:
        return self._max_tokens is None or self._max_tokens - self._generated > 1

    async def _default_bid(self) -> float | None:
        """This step's bid (Pie's rule), unless the inferlet set one or is idle; None without a market.

        The tokens still expected: ``horizon`` minus those generated (exactly), else ``max_tokens`` minus them
        (cv² = 1), else as many as generated so far, at least 64 (the Lindy rule)."""
        ctx = self._ctx
        if not ctx._bids_by_default:
            return None
        readings = self._bid_basis = await scheduling.step_readings(ctx.model)
        if readings is None:
            return None
        if self._horizon is not None:
            expected, cv2 = self._horizon - self._generated, 0.0
        elif self._max_tokens is not None:
            expected, cv2 = self._max_tokens - self._generated, 1.0
        else:
            expected, cv2 = max(self._generated, 64), 1.0
        pages = max(pages_for(ctx.seq_len, ctx.page_size), 1)
        return scheduling.default_bid(readings["balance"], pages, expected, cv2, ctx.page_size, readings["dividend"])

    def _draft(self, fwd: Forward) -> int:
        """Attach this step's drafts to ``fwd``; returns how many the speculator proposed (0 for the system's)."""
        first = fwd._positions[-1] + 1
        if self._speculator is not None:
            drafts, positions = _checked_proposal(self._speculator.draft(), first)
            proposed = len(drafts)
        else:
            drafts, proposed = self._system_drafts, 0
        if self._max_tokens is not None:  # every step yields one token past its accepted drafts
            drafts = drafts[: max(0, self._max_tokens - self._generated - 1)]
        drafts, fwd._draft_masks = self._constraints.lookahead(drafts)
        fwd._drafts, fwd._draft_positions = drafts, list(range(first, first + len(drafts)))
        return proposed

    def accept(self, tokens: list[int]) -> list[int]:
        """Register tokens chosen by hand (after ``clear_sampler``); returns what was kept: tokens from the first one
        a constraint forbids are dropped, then stop/max cuts apply."""
        kept, _ = self._fold([int(t) for t in tokens])
        self._system_drafts = []  # they guessed what follows the sampled token, not these
        if self._speculator is not None:
            self._speculator.accept(kept)
        return kept

    def _fold(self, tokens: list[int], in_kv: int = 0) -> tuple[list[int], int]:
        """Reconcile with the constraints, apply stop tokens and ``max_tokens``, and count the survivors.

        The first ``in_kv`` tokens (accepted drafts) already have KV. Afterwards KV and buffer are what a run without
        drafts leaves: every survivor is in the KV but the last, which is queued as the next step's input — unless
        a stop token ended generation, whose step flushed them all. Returns the survivors and how many in-KV tokens
        must be truncated for that.
        """
        kept: list[int] = []
        stopped = False
        for t in self._constraints.admit(tokens):
            if t in self._stop:
                self._done = stopped = True
                break
            kept.append(t)
        if self._max_tokens is not None:
            room = self._max_tokens - self._generated
            if len(kept) >= room:
                kept, self._done = kept[:room], True
        self._generated += len(kept)
        stays = max(0, min(len(kept) if stopped else len(kept) - 1, in_kv))
        self._ctx._buffer += kept[stays:]
        if not self._done and self._constraints and self._constraints.terminated:
            self._done = True
        return kept, in_kv - stays

    # -- collectors ----------------------------------------------------------------------------------------------

    async def collect_tokens(self) -> list[int]:
        tokens: list[int] = []

        def take(out: Output) -> bool:
            tokens.extend(out.tokens)
            return False

        await self._drain(take)
        return tokens

    async def collect_text(self) -> str:
        """Drain and return the visible text (a chat decoder strips control tokens)."""
        decoder = chat.Decoder(self._ctx.model)
        parts: list[str] = []
        done: list[str] = []

        def take(out: Output) -> bool:
            event = decoder.feed(out.tokens)
            if isinstance(event, chat.Delta):
                parts.append(event.text)
            elif isinstance(event, chat.Done):
                done.append(event.text)
                return True
            return False

        await self._drain(take)
        return done[0] if done else "".join(parts)

    async def _drain(self, take: Callable[[Output], bool]) -> None:
        """Step until done, handing each step's output to ``take`` (which returns True to stop early)."""
        if self._constraints or self._speculator is not None or self._system_speculation:
            async for step in self:
                if take(await step.execute()):
                    return
            return
        await self._drain_chained(take)

    async def _drain_chained(self, take: Callable[[Output], bool]) -> None:
        """Plain stepping with the next run of steps always in flight (see the module docstring)."""
        ctx = self._ctx
        if self.is_done:
            return
        if not ctx._buffer:
            self._done = True
            return
        cur: _Sent | None = await self._send_step(ctx.buffer(), ctx.seq_len)
        ctx._buffer = []
        nxt: _Sent | None = None
        stop_ids = sorted(self._stop)  # nothing can change them while this runs
        try:
            while cur is not None:
                room = CHAIN_STEPS if self._max_tokens is None else self._max_tokens - self._generated - cur.steps
                if room > 0:
                    nxt = await self._send_step(None, cur.end, stop_ids, min(room, CHAIN_STEPS), cur.steps)
                reply = await asyncio.shield(cur.reply)
                steps, cur = self._read(cur, reply), None
                for surplus, out in steps:
                    if take(out):
                        if nxt is not None:
                            surplus += await self._undo(nxt)
                            nxt = None
                        if surplus:
                            ctx._seq_len = await ctx.model.channel.call("truncate", ctx._id, surplus)
                        return
                if nxt is not None and not self._done:  # the chained pass feeds the token the buffer now holds
                    nxt.fed, ctx._buffer = ctx._buffer, []
                    cur, nxt = nxt, None
        finally:
            await self._unchain(cur, nxt)

    async def _send_step(
        self, tokens: list[int] | None, position: int, stop_ids: list[int] | None = None, steps: int = 1, after: int = 0
    ) -> _Sent:
        """Send a plain step: ``tokens`` from ``position`` on, or (None) a pass chained on the previous one, which
        the replica runs for up to ``steps`` steps, each on the token the step before sampled, ending after one
        that samples a token of ``stop_ids`` (and skipping the pass if its first input is one). ``after``: the
        steps of the pass it is chained on, whose tokens it may have to let be undone too."""
        fwd = Forward(self._ctx)
        if tokens is None:  # the replica supplies the token
            fwd._positions, last = [position], 0
        else:
            fwd.input_at(tokens, list(range(position, position + len(tokens))))
            last = len(tokens) - 1
        if self._adapter is not None:
            fwd.adapter(self._adapter)
        if self._zo_seed is not None:
            fwd.zo_seed(self._zo_seed)
        for idx, probe in self._step_probes:
            fwd.probe(last + idx, probe)
        auto = fwd.sample([last], self._sampler)
        bid = await self._default_bid()
        if bid is not None and bid != self._ctx._bid:
            fwd._bid = self._ctx._bid = bid
        reply = fwd._send() if tokens is not None else fwd._send(chained=stop_ids, steps=steps, hold=steps + after)
        return _Sent(fwd, auto, reply, tokens, steps, fwd._positions[-1] + steps)

    def _read(self, sent: _Sent, reply: list) -> Iterator[tuple[int, Output]]:
        """Fold a sent pass's tokens in one by one, as single steps would, each token moving from the buffer into
        the KV as the next step ran; yields, per token, its Output (the last one carries the pass's slots) and how
        many tokens after it the KV holds already."""
        out = sent.fwd._finish(reply)
        out.auto_sampler = sent.auto
        walk = sent.fwd._walk if not sent.fwd._tokens else [out.token(sent.auto)]  # a chained pass lists its tokens
        for i, token in enumerate(walk):
            step = out if i == len(walk) - 1 else Output([], auto_sampler=sent.auto)
            if i:
                self._ctx._buffer = []
            step.tokens, _ = self._fold([token])
            yield len(walk) - 1 - i, step

    async def _undo(self, sent: _Sent) -> int:
        """Wait for a chained pass nobody will read; returns how many tokens it wrote to the KV."""
        try:
            reply = await sent.reply
        except Exception:  # it failed, or followed a pass that did: nothing reached the KV
            return 0
        return 0 if reply is None else len(reply[1])  # None: skipped, as the token it would feed stops generation

    async def _unchain(self, cur: _Sent | None, nxt: _Sent | None) -> None:
        """Leave the context as stepping one by one would have: read a pass whose reply was not read (the collector
        was cancelled or failed while waiting), and undo a chained pass nobody will read (truncating the tokens it
        wrote). Replies are awaited to the end, so the state is known."""
        ctx = self._ctx
        if cur is not None:
            try:
                for _ in self._read(cur, await cur.reply):
                    pass
            except Exception:  # nothing of it reached the KV
                ctx._buffer = cur.fed + ctx._buffer
        if nxt is None:
            return
        if written := await self._undo(nxt):  # the token it fed stays in the buffer, as it never moved from there
            ctx._seq_len = await ctx.model.channel.call("truncate", ctx._id, written)

    async def collect_json(self, *, schema: str | dict | None = None, parse: Callable[[str], Any] | None = None) -> Any:
        """Constrain to JSON (matching ``schema`` if given), drain, and return ``json.loads`` of the text, or
        ``parse(text)``."""
        self.constrain(JsonSchema(schema) if schema is not None else AnyJson())
        text = await self.collect_text()
        if parse is not None:
            return parse(text)
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"collect_json: the output is not complete JSON ({e.msg}) after {self._generated} tokens "
                f"(max_tokens={self._max_tokens}): {text[:200]!r}"
            ) from None


def _checked_proposal(proposal, first: int) -> tuple[list[int], list[int]]:
    """A speculator's ``draft()`` result as (tokens, positions), which must continue the context at ``first``."""
    try:
        tokens, positions = proposal
        tokens, positions = [int(t) for t in tokens], [int(p) for p in positions]
    except (TypeError, ValueError):
        raise TypeError(
            f"Speculator.draft() must return (tokens, positions), two lists of ints; got {proposal!r:.120}"
        ) from None
    if len(tokens) != len(positions):
        raise ValueError(f"Speculator.draft() returned {len(tokens)} tokens but {len(positions)} positions")
    expected = list(range(first, first + len(tokens)))
    if positions != expected:
        raise ValueError(
            f"Speculator.draft() returned positions {positions[:8]} but drafts must continue the context in order "
            f"right after the step's input: {expected[:8]}"
        )
    return tokens, positions
