"""Chat turns as token lists, and the streaming chat parser (`Decoder`).

`model` is anything with `.tokenizer() -> Tokenizer` and `.instruct: Instruct` (the SDK's `Model`). The helpers
return token ids for `Context.append`; the family template lives in `inferlet.instruct`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

from inferlet.instruct import ModelLike
from inferlet.tokenizer import TextStream


def system(model: ModelLike, msg: str) -> list[int]:
    """Tokens of a system turn."""
    return model.instruct.system(msg)


def user(model: ModelLike, msg: str) -> list[int]:
    """Tokens of a user turn."""
    return model.instruct.user(msg)


def assistant(model: ModelLike, msg: str) -> list[int]:
    """Tokens of a pre-filled (closed) assistant turn."""
    return model.instruct.assistant(msg)


def cue(model: ModelLike) -> list[int]:
    """Tokens that open the assistant turn the model generates next."""
    return model.instruct.cue()


def seal(model: ModelLike) -> list[int]:
    """Tokens that close a generated assistant turn (the template's turn ending; see `Instruct.seal`)."""
    return model.instruct.seal()


def stop_tokens(model: ModelLike) -> list[int]:
    """Ids that end the model's turn: pass to `Generator.stop`, extended with your own if needed."""
    return model.instruct.stop_tokens()


class Event:
    """What one `Decoder.feed` produced; match on `Event.Idle()`, `Event.Delta(text)`, `Event.Done(text)`,
    `Event.Interrupt(token)`."""

    __slots__ = ()
    Idle: ClassVar[type[Idle]]
    Delta: ClassVar[type[Delta]]
    Done: ClassVar[type[Done]]
    Interrupt: ClassVar[type[Interrupt]]


@dataclass(frozen=True, slots=True)
class Idle(Event):
    """The batch produced no new visible text (e.g. only part of a multi-byte character)."""


@dataclass(frozen=True, slots=True)
class Delta(Event):
    """New visible text."""

    text: str


@dataclass(frozen=True, slots=True)
class Done(Event):
    """The model ended its turn; `text` is the whole reply."""

    text: str


@dataclass(frozen=True, slots=True)
class Interrupt(Event):
    """The model emitted a control (special, non-stop) token; it is left out of the text."""

    token: int


Event.Idle, Event.Delta, Event.Done, Event.Interrupt = Idle, Delta, Done, Interrupt


class Decoder:
    """Turns the generated token stream into text events; one event per `feed`.

    Stop tokens end the turn (`Done` with the full reply, then the decoder resets; tokens after the stop in the same
    batch are dropped, as the Generator never sends them). Other special tokens are kept out of the text and
    reported as `Interrupt` (the first one of a batch); text from the same batch is not lost but comes with the next
    `Delta` or `Done`. Text is not filtered otherwise: a `<think>` block shows up too (see `reasoning.Decoder`).
    """

    def __init__(self, model: ModelLike) -> None:
        tokenizer = model.tokenizer()
        self._stops = frozenset(model.instruct.stop_tokens())
        self._control = tokenizer.special_ids - self._stops
        self._stream = TextStream(tokenizer)
        self._pending = ""

    def reset(self) -> None:
        """Start a new turn: forget buffered tokens and text."""
        self._stream.reset()
        self._pending = ""

    def feed(self, tokens: Iterable[int]) -> Event:
        """Consume the tokens of one generation step."""
        text_tokens: list[int] = []
        interrupt = None
        for token in tokens:
            if token in self._stops:
                self._stream.push(text_tokens)
                reply = self._stream.text()
                self.reset()
                return Done(reply)
            if token in self._control:
                interrupt = token if interrupt is None else interrupt
            else:
                text_tokens.append(token)
        self._pending += self._stream.push(text_tokens)
        if interrupt is not None:
            return Interrupt(interrupt)
        if not self._pending:
            return Idle()
        delta, self._pending = self._pending, ""
        return Delta(delta)
