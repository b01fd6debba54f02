"""Test helper: the grammars, schemas and tools the constraint tests constrain to, with and without a replica."""

from __future__ import annotations

import re

STOPS = [2, 0]  # <|im_end|>, <|endoftext|>: the ChatML template's end-of-turn set
SEEDS = range(1, 13)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
        "home": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "score": {"enum": [1, 2.5, None]}},
            "required": ["zip", "score"],
        },
    },
    "required": ["name", "age", "tags", "ok", "home"],
}
ANSWER = r"(yes|no): [0-9]{1,3}(\.[0-9])?"
GREETING_LARK = 'start: GREETING " " NAME "!"\nGREETING: "hello" | "hi"\nNAME: /[a-z]{1,6}/\n'
GREETING_GBNF = 'root ::= ("hello" | "hi") " " [a-z]{1,6} "!"'
GREETING = re.compile(r"(hello|hi) [a-z]{1,6}!")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
CLOCK = {"name": "get_time", "parameters": {"type": "object", "properties": {}, "required": []}}
