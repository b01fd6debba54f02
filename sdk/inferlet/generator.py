"""``Generator``: the multi-step decode loop over a context — sampling, stop conditions, manual stepping.

Each step runs the context's buffer (the prompt on the first step, then the previous token) with the auto sampler
on its last row, folds the sampled token into the state, and decides whether to stop: ``max_tokens`` reached, a
token of the stop set (the chat template's end-of-turn tokens plus any you add; never replacing them), or
``accept``-ed tokens doing either. The token that ends a turn is not kept; ``ctx.seal()`` closes the turn.
Probe indices count from the step's output row: 0 is the row that predicts the next token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from inferlet import chat
from inferlet.forward import Forward, Output, ProbeHandle, SampleHandle
from inferlet.sampler import Probe, Sampler

if TYPE_CHECKING:
    from inferlet.context import Context

_LATER = "lands with constrained generation, speculation and adapters (not in this build yet)"


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
        constrain=None,
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
        for name, value in (
            ("constrain", constrain),
            ("speculator", speculator),
            ("adapter", adapter),
            ("zo_seed", zo_seed),
        ):
            if value is not None:
                raise NotImplementedError(f"Generator {name}= {_LATER}")
        if system_speculation:
            raise NotImplementedError(f"Generator system_speculation= {_LATER}")
        if not isinstance(sampler, Sampler):
            raise TypeError(f"generate() needs a Sampler, got {type(sampler).__name__}")
        if max_tokens is not None and max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        ctx._check_live()
        self._ctx = ctx
        self._sampler = sampler
        self._max_tokens = max_tokens
        self._logit_mask = list(logit_mask) if logit_mask else None
        self._horizon = horizon
        if auto_flush:
            ctx.cue()
            self._stop = set(chat.stop_tokens(ctx.model)) | set(stop or [])
        else:
            self._stop = set(stop or [])
        self._step_probes: list[tuple[int, Probe]] = []
        self._generated = 0
        self._done = False

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

    def constrain(self, c) -> Generator:
        raise NotImplementedError(f"Generator.constrain {_LATER}")

    def adapter(self, a) -> Generator:
        raise NotImplementedError(f"Generator.adapter {_LATER}")

    def zo_seed(self, seed: int) -> Generator:
        raise NotImplementedError(f"Generator.zo_seed {_LATER}")

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
        fwd = Forward(ctx)
        fwd.input(pending)
        last = len(pending) - 1
        for idx, probe in step._every_step + step._probes:
            fwd.probe(last + idx, probe)
        auto: SampleHandle | None = None if step._cleared else fwd.sample([last], self._sampler)
        if self._logit_mask:
            fwd.mask(self._logit_mask)
        ctx._buffer = []
        try:
            out = await fwd.execute()
        except BaseException:
            ctx._buffer = pending  # nothing reached the KV cache
            raise
        out.auto_sampler = auto
        if auto is not None:
            out.tokens = self._fold([out.token(auto)])
        return out

    def accept(self, tokens: list[int]) -> list[int]:
        """Register tokens chosen by hand (after ``clear_sampler``); returns what was kept after stop/max cuts."""
        return self._fold([int(t) for t in tokens])

    def _fold(self, tokens: list[int]) -> list[int]:
        """Apply stop tokens and ``max_tokens``, count the survivors, and queue them for the next step."""
        kept = []
        for t in tokens:
            if t in self._stop:
                self._done = True
                break
            kept.append(t)
        if self._max_tokens is not None:
            room = self._max_tokens - self._generated
            if len(kept) >= room:
                kept, self._done = kept[:room], True
        self._generated += len(kept)
        self._ctx._buffer += kept
        return kept

    # -- collectors ----------------------------------------------------------------------------------------------

    async def collect_tokens(self) -> list[int]:
        tokens: list[int] = []
        async for step in self:
            tokens += (await step.execute()).tokens
        return tokens

    async def collect_text(self) -> str:
        """Drain and return the visible text (a chat decoder strips control tokens)."""
        decoder = chat.Decoder(self._ctx.model)
        parts: list[str] = []
        async for step in self:
            event = decoder.feed((await step.execute()).tokens)
            if isinstance(event, chat.Delta):
                parts.append(event.text)
            elif isinstance(event, chat.Done):
                return event.text
        return "".join(parts)

    async def collect_json(self, *, schema=None, parse=None):
        raise NotImplementedError(f"Generator.collect_json {_LATER}")
