"""Streaming parser for reasoning blocks (`<think>…</think>`) in the generated token stream.

Markers are matched on decoded text, not on token ids, so they are found however the tokenizer splits them (one
added token in Qwen3, several ordinary tokens in a model without them) and even when split across steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

from inferlet.instruct import ModelLike
from inferlet.tokenizer import TextStream


class Event:
    """What one `Decoder.feed` produced; match on `Event.Idle()`, `Event.Start()`, `Event.Delta(text)`,
    `Event.End(text)`."""

    __slots__ = ()
    Idle: ClassVar[type[Idle]]
    Start: ClassVar[type[Start]]
    Delta: ClassVar[type[Delta]]
    End: ClassVar[type[End]]


@dataclass(frozen=True, slots=True)
class Idle(Event):
    """No new reasoning text."""


@dataclass(frozen=True, slots=True)
class Start(Event):
    """A reasoning block opened."""


@dataclass(frozen=True, slots=True)
class Delta(Event):
    """New reasoning text."""

    text: str


@dataclass(frozen=True, slots=True)
class End(Event):
    """The reasoning block closed; `text` is all of it (the concatenation of its deltas)."""

    text: str


Event.Idle, Event.Start, Event.Delta, Event.End = Idle, Start, Delta, End


def _held(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could be the start of `marker` (kept until the next feed)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


class Decoder:
    """Reports reasoning blocks; one event per `feed`, the most significant of the batch (End > Start > Delta).

    Nothing is lost to that rule: reasoning text that arrives with a `Start` comes with the next `Delta`/`End`,
    and text after an `End` is scanned by the next feed. Models without reasoning markers only ever get `Idle`.
    """

    def __init__(self, model: ModelLike) -> None:
        tokenizer = model.tokenizer()
        self._markers = model.instruct.reasoning_markers
        self._special = tokenizer.special_ids
        self._stream = TextStream(tokenizer)
        self.reset()

    def reset(self) -> None:
        """Forget all state, back outside any block."""
        self._stream.reset()
        self._inside = False
        self._carry = ""  # text not yet scanned: a possible partial marker, or what followed an `End`
        self._said = ""  # reasoning text of the open block already reported as Delta
        self._unsaid = ""  # reasoning text of the open block not yet reported

    def feed(self, tokens: Iterable[int]) -> Event:
        """Consume the tokens of one generation step."""
        if self._markers is None:
            return Idle()
        open_, close = self._markers
        text = self._carry + self._stream.push(t for t in tokens if t not in self._special)
        self._carry = ""
        started = False
        while text:
            if not self._inside:
                at = text.find(open_)
                if at < 0:
                    self._carry = text[len(text) - _held(text, open_) :]
                    break
                text = text[at + len(open_) :]
                self._inside = started = True
                continue
            at = text.find(close)
            if at >= 0:
                block = self._said + self._unsaid + text[:at]
                self._carry = text[at + len(close) :]
                self._inside, self._said, self._unsaid = False, "", ""
                return End(block)
            keep = _held(text, close)
            self._unsaid += text[: len(text) - keep]
            self._carry = text[len(text) - keep :]
            break
        if started:
            return Start()
        if not self._unsaid:
            return Idle()
        delta, self._unsaid = self._unsaid, ""
        self._said += delta
        return Delta(delta)
