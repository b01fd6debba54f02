"""``Generator``: the multi-step decode loop over a context — sampling, stop conditions, manual stepping.

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

The collectors (``collect_tokens``, ``collect_text``) hand no step to user code; without constraints or speculation
they run chained passes, the next always in flight (``chained.py``). A generation's state and the pass of one step
are ``Generation``'s (``generation.py``).

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

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from inferlet import chat
from inferlet.adapter import Adapter, check_zo_seed
from inferlet.chained import drain_chained
from inferlet.constraints import AnyJson, Constraint, ConstraintSet, JsonSchema, Schema
from inferlet.forward import Forward, Output, ProbeHandle, SampleHandle
from inferlet.generation import Generation
from inferlet.sampler import Probe, Sampler
from inferlet.spec import Speculator

if TYPE_CHECKING:
    from inferlet.context import Context

SYSTEM_DRAFTS = 4  # n-gram drafts asked of the replica per step with system_speculation


class GenStep:
    def __init__(self, gen: Generator):
        self._gen = gen
        self.cleared = False
        self.every_step_probes = list(gen.state.step_probes)  # slots: these, then this step's own, then the sampler
        self.own_probes: list[tuple[int, Probe]] = []
        self._executed = False

    def clear_sampler(self) -> GenStep:
        """Drop the auto sampler: the pass still runs; read a probe and ``g.accept([...])`` your own token."""
        self.cleared = True
        return self

    def probe(self, idx: int, probe: Probe) -> ProbeHandle:
        """Attach a probe for this step only; its handle indexes this step's output."""
        self.own_probes.append((idx, probe))
        return ProbeHandle(len(self.every_step_probes) + len(self.own_probes) - 1, probe.kind)

    async def execute(self) -> Output:
        if self._executed:
            raise ValueError("this generation step was already executed")
        self._executed = True
        return await self._gen.run_step(self)


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
        ctx.check_live()
        constraints = ConstraintSet(ctx.model)
        if logit_mask:
            constraints.add_mask(logit_mask)
        if constrain is not None:
            constraints.add(constrain)
        if auto_flush:
            ctx.cue()
            stop_set = set(chat.stop_tokens(ctx.model)) | set(stop or [])
        else:
            stop_set = set(stop or [])
        self.state = Generation(ctx, sampler, constraints, stop_set, max_tokens=max_tokens, horizon=horizon)
        if adapter is not None:
            self.adapter(adapter)
        if zo_seed is not None:
            self.zo_seed(zo_seed)
        self._speculator: Speculator | None = speculator
        self._system_speculation = system_speculation
        self._system_drafts: list[int] = []  # the replica's n-gram drafts for the next step

    # -- builder -------------------------------------------------------------------------------------------------

    def max_tokens(self, n: int) -> Generator:
        self.state.max_tokens = n
        return self

    def stop(self, tokens: list[int]) -> Generator:
        """Replace the stop set."""
        self.state.stop = set(tokens)
        return self

    def add_stop(self, tokens: list[int]) -> Generator:
        self.state.stop |= set(tokens)
        return self

    def horizon(self, n: int) -> Generator:
        """Hint at the expected output length (used by the credit market's bidding)."""
        self.state.horizon = n
        return self

    def constrain(self, c: Schema | Constraint | list[Schema | Constraint]) -> Generator:
        """Add a constraint (or a list); it composes with those already attached and applies from the next step."""
        self.state.constraints.add(c)
        return self

    def adapter(self, a: Adapter) -> Generator:
        """Apply a LoRA adapter on every step (the prompt's included, if it has not been flushed)."""
        if not isinstance(a, Adapter):
            raise TypeError(f"adapter() needs an Adapter, got {type(a).__name__}")
        self.state.adapter = a
        return self

    def zo_seed(self, seed: int) -> Generator:
        """Perturb the adapter by this Evolution Strategies seed on every step."""
        self.state.zo_seed = check_zo_seed(seed)
        return self

    def probe_each_step(self, idx: int, probe: Probe) -> ProbeHandle:
        """Attach a probe to every step; the handle is valid on each step's output."""
        self.state.step_probes.append((idx, probe))
        return ProbeHandle(len(self.state.step_probes) - 1, probe.kind)

    # -- state ---------------------------------------------------------------------------------------------------

    @property
    def tokens_generated(self) -> int:
        return self.state.generated

    @property
    def is_done(self) -> bool:
        return self.state.is_done

    # -- stepping ------------------------------------------------------------------------------------------------

    def __aiter__(self) -> Generator:
        return self

    async def __anext__(self) -> GenStep:
        if self.is_done:
            raise StopAsyncIteration
        return GenStep(self)

    async def run_step(self, step: GenStep) -> Output:
        """Run one step (``GenStep.execute``): the buffer with the step's probes and sampler, and drafts."""
        state, ctx = self.state, self.state.ctx
        if not ctx.buffer():
            state.done = True
            return Output([])
        out, auto, proposed = await self._execute_step(step, ctx.buffer())
        if auto is not None:
            self._system_drafts = out.next_drafts
            walk = out.walk or [out.token(auto)]
            out.tokens, surplus = state.fold(walk, in_kv=len(walk) - 1)
            if surplus:  # a stop or max_tokens cut inside the accepted drafts: their KV goes too
                await ctx.truncate_async(surplus)
            if self._speculator is not None:
                self._speculator.accept(out.tokens)
                if proposed > len(walk) - 1:
                    self._speculator.rollback(proposed - (len(walk) - 1))
        return out

    async def _execute_step(self, step: GenStep, pending: list[int]) -> tuple[Output, SampleHandle | None, int]:
        """The step's pass over the buffered tokens (``pending``), sent and answered; with the auto sampler's handle
        and how many drafts the speculator proposed. The buffer is left as it was until the pass goes (a speculator
        reads it), and again if the pass fails."""
        state = self.state
        mask = state.constraints.step_mask()
        fwd, auto = await state.step_pass(
            pending, state.ctx.seq_len, step.every_step_probes + step.own_probes, sample=not step.cleared
        )
        if mask is not None:
            fwd.mask(mask)
        proposed, drafted = self._draft(fwd, len(pending)) if auto is not None else (0, 0)
        if self._system_speculation and auto is not None:
            fwd.ask_drafts(SYSTEM_DRAFTS)
        elif auto is not None and mask is None and not drafted and state.more_than_one_left():
            fwd.run_ahead(sorted(state.stop))  # the replica runs the next step while this one's answer travels
        ctx = state.ctx
        ctx.take_buffer()
        try:
            out = await fwd.execute()
        except BaseException:
            ctx.requeue(pending)  # nothing reached the KV cache
            raise
        out.auto_sampler = auto
        return out, auto, proposed

    def _draft(self, fwd: Forward, inputs: int) -> tuple[int, int]:
        """Attach this step's drafts to ``fwd`` (after its ``inputs`` tokens); returns how many the speculator
        proposed (0 for the system's) and how many were attached."""
        state = self.state
        first = state.ctx.seq_len + inputs
        if self._speculator is not None:
            drafts, _ = _checked_proposal(self._speculator.draft(), first)
            proposed = len(drafts)
        else:
            drafts, proposed = self._system_drafts, 0
        if state.max_tokens is not None:  # every step yields one token past its accepted drafts
            drafts = drafts[: max(0, state.max_tokens - state.generated - 1)]
        drafts, masks = state.constraints.lookahead(drafts)
        if drafts:
            fwd.drafts(drafts, masks)
        return proposed, len(drafts)

    def accept(self, tokens: list[int]) -> list[int]:
        """Register tokens chosen by hand (after ``clear_sampler``); returns what was kept: tokens from the first one
        a constraint forbids are dropped, then stop/max cuts apply."""
        kept, _ = self.state.fold([int(t) for t in tokens])
        self._system_drafts = []  # they guessed what follows the sampled token, not these
        if self._speculator is not None:
            self._speculator.accept(kept)
        return kept

    # -- collectors ----------------------------------------------------------------------------------------------

    async def collect_tokens(self) -> list[int]:
        tokens: list[int] = []

        def take(out: Output) -> bool:
            tokens.extend(out.tokens)
            return False

        await self.drain(take)
        return tokens

    async def collect_text(self) -> str:
        """Drain and return the visible text (a chat decoder strips control tokens)."""
        decoder = chat.Decoder(self.state.ctx.model)
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

        await self.drain(take)
        return done[0] if done else "".join(parts)

    async def drain(self, take: Callable[[Output], bool]) -> None:
        """Step until done, handing each step's output to ``take`` (which returns True to stop early): what the
        collectors do, for a collector of one's own."""
        if self.state.constraints or self._speculator is not None or self._system_speculation:
            async for step in self:
                if take(await step.execute()):
                    return
            return
        await drain_chained(self.state, take)

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
                f"collect_json: the output is not complete JSON ({e.msg}) after {self.state.generated} tokens "
                f"(max_tokens={self.state.max_tokens}): {text[:200]!r}"
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
