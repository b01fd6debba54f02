"""Which replica of a model serves an OpenAI request that the ingress runs itself: prefix-aware placement.

Every replica keeps its own prefix trie of KV pages, so a prompt is cheap only on a replica that has served its
beginning before. Sending requests that share a long prefix (a system prompt, a few-shot preamble, a conversation so
far) to the same replica turns that prefix into cache hits instead of one recomputation per replica; spreading them
evenly (least loaded) recomputes it everywhere. Pure affinity, though, piles a popular prefix onto one replica while
the others idle, so load overrides it past a threshold. This is what Ray Serve LLM's prefix-affinity router and
vLLM's data-parallel users do; here it runs in each ingress replica for the requests it serves, with no central
state and no call to the replicas (their tries are not asked: the ingress remembers what it sent where).

What is remembered: the rendered request text (chat messages in order, a completion's prompt, a response's
instructions and items) cut into fixed blocks of ``block_chars`` characters, each hashed together with the hash of
the blocks before it (a chained hash, as vLLM's prefix cache keys its blocks). A replica's record is an LRU set of
such hashes, at most ``max_blocks`` of them per replica and model: memory stays bounded however many distinct
prompts pass, and the matched prefix of a new request is its run of leading blocks found in the record — since each
hash covers everything before it, one hit at block k means blocks 0..k matched too. Characters stand in for
tokens: the ingress has not tokenized the request yet, and the ratio is near constant within a model. A trie of
characters would find partial blocks too, at many times the memory; block granularity (64 characters, ~16 tokens,
one KV page of 16 tokens) is what the replica's page-sized trie can reuse anyway.

The rule (``routing = "prefix"``): the replica with the longest matched prefix, unless its requests in flight
exceed ``LOAD_FACTOR`` × the least loaded replica's + ``LOAD_SLACK``, in which case the least loaded; ties (and no
match at all) go to the least loaded, then to the one picked longest ago. A request that continues an earlier one
(a Responses turn with ``previous_response_id``, whose stored context's text the ingress does not have) goes where
that one went, within the same load limit: its snapshot's pages are there. ``routing = "least_loaded"`` skips the
prefix and continuation parts. With one replica nothing is hashed or counted.

Whose prefix it is counts too: a replica's cache finds a page only for the user who wrote it, under the cache salt
its request named (``[cache] share = "user"``, the default), so the chain of a request's hashes starts from its
user and salt, and one user's prompts are placed by that user's own earlier requests, never by another's. With
``share = "cluster"`` only the salt seeds it, as the replicas' caches then key pages.
"""

from __future__ import annotations

import itertools
import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

Routing = Literal["prefix", "least_loaded"]
BLOCK_CHARS = 64  # one block of the record: ~16 tokens, a KV page of the default page size
MAX_BLOCKS = 8192  # per replica and model: ~1 MB of hashes, the prefixes of ~100 distinct 5k-character prompts
MAX_REQUEST_BLOCKS = 1024  # a request's first 64k characters decide; the rest is never shared anyway (or rarely)
LOAD_FACTOR = 2  # affinity holds while in flight <= LOAD_FACTOR * least + LOAD_SLACK
LOAD_SLACK = 4
MAX_PINS = 16384  # requests remembered for their continuations (Responses turns), per ingress process


@dataclass
class _Replica:
    """What the router knows of one replica of one model: recently sent prefixes and requests now running there."""

    blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)  # chained block hashes, oldest first
    in_flight: int = 0
    last_picked: int = 0  # the router's pick counter when this one was last chosen: ties rotate


def block_hashes(
    text: str, block_chars: int = BLOCK_CHARS, limit: int = MAX_REQUEST_BLOCKS, seed: int = 0
) -> list[int]:
    """Chained hashes of the full ``block_chars`` blocks of ``text``: entry k stands for ``text[: (k + 1) * size]``
    under ``seed`` (whose cache the blocks would be found in)."""
    hashes, chained = [], seed
    for start in range(0, min(len(text), limit * block_chars) - block_chars + 1, block_chars):
        chained = hash((chained, text[start : start + block_chars]))
        hashes.append(chained)
    return hashes


@dataclass(frozen=True)
class Prompt:
    """What places a request: its model, and its prompt rendered as text in the order the model reads it."""

    model: str
    text: str
    tag: str | None = None  # names this request for a later one that continues it (a response id)
    follows: str | None = None  # the tag of the request this one continues
    cache_salt: str | None = None  # the request's own salt: only requests naming the same one share its pages

    @classmethod
    def of(
        cls,
        model: str,
        parts: Sequence[object],
        tag: str | None = None,
        follows: str | None = None,
        cache_salt: str | None = None,
    ) -> Prompt:
        """From the request's prompt-bearing parts in order (messages, a prompt, instructions and items): one JSON
        line each, so requests that share their first parts share a text prefix."""
        text = "\n".join(json.dumps(p, sort_keys=True, separators=(",", ":")) for p in parts)
        return cls(model, text, tag, follows, cache_salt)


class PrefixRouter:
    """Picks a replica per request and counts what is in flight on each; one per ingress process (not shared)."""

    def __init__(
        self,
        routing: Routing = "prefix",
        block_chars: int = BLOCK_CHARS,
        max_blocks: int = MAX_BLOCKS,
        shared_prefixes: bool = False,
    ):
        """``shared_prefixes``: the replicas' caches find any user's pages (``[cache] share = "cluster"``)."""
        self.routing, self.block_chars, self.max_blocks = routing, block_chars, max_blocks
        self.shared_prefixes = shared_prefixes
        self._replicas: dict[tuple[str, str], _Replica] = {}  # (model, replica key) -> its record
        self._picks = itertools.count(1)
        self._pins: OrderedDict[tuple[str, str], str] = OrderedDict()  # (model, tag) -> where it went, oldest first

    def choose(
        self,
        model: str,
        keys: Sequence[str],
        text: str,
        tag: str | None = None,
        follows: str | None = None,
        user: str = "",
        cache_salt: str | None = None,
    ) -> str:
        """The replica (one of ``keys``, e.g. their addresses) to send a request of ``user`` for ``model`` with
        prompt ``text`` to; counts it in flight there until ``finished``. ``tag``/``follows``/``cache_salt``: see
        ``Prompt``."""
        if len(keys) == 1:
            return keys[0]
        replicas = [self._replicas.setdefault((model, k), _Replica()) for k in keys]
        least = min(r.in_flight for r in replicas)
        prefix = self.routing == "prefix"
        owner = None if self.shared_prefixes else user
        hashes = block_hashes(text, self.block_chars, seed=hash((owner, cache_salt or ""))) if prefix else []
        matched = [self._matched(r, hashes) for r in replicas]
        pinned = self._pins.get((model, follows)) if prefix and follows is not None else None

        def rank(i: int) -> tuple:
            r = replicas[i]
            affine = r.in_flight <= LOAD_FACTOR * least + LOAD_SLACK
            return (not (affine and keys[i] == pinned), -matched[i] if affine else 0, r.in_flight, r.last_picked)

        best = min(range(len(keys)), key=rank)
        chosen = replicas[best]
        chosen.in_flight += 1
        chosen.last_picked = next(self._picks)
        self._remember(chosen, hashes)
        if prefix and tag is not None:
            self._pins[model, tag] = keys[best]
            if len(self._pins) > MAX_PINS:
                self._pins.popitem(last=False)
        return keys[best]

    def finished(self, model: str, key: str) -> None:
        """A request ``choose`` sent to ``key`` has ended (whichever way)."""
        replica = self._replicas.get((model, key))
        if replica is not None and replica.in_flight > 0:
            replica.in_flight -= 1

    def in_flight(self, model: str, key: str) -> int:
        replica = self._replicas.get((model, key))
        return 0 if replica is None else replica.in_flight

    def remembered(self, model: str, key: str) -> int:
        """How many prefix blocks the record of ``key`` holds (at most ``max_blocks``)."""
        replica = self._replicas.get((model, key))
        return 0 if replica is None else len(replica.blocks)

    def forget(self, model: str, keep: Sequence[str]) -> None:
        """Drop the records of ``model``'s replicas not in ``keep`` (a replaced replica has a new address)."""
        for gone in [k for k in self._replicas if k[0] == model and k[1] not in keep]:
            del self._replicas[gone]

    @staticmethod
    def _matched(replica: _Replica, hashes: list[int]) -> int:
        """Leading blocks of the request the replica was sent before (chained: the first miss ends the match)."""
        n = 0
        for h in hashes:
            if h not in replica.blocks:
                break
            n += 1
        return n

    def _remember(self, replica: _Replica, hashes: list[int]) -> None:
        blocks = replica.blocks
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)
