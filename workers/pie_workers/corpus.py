"""The fixed, generated text the embedded tiny model's tokenizer is trained on.

Why generated: the default model must build offline with no data downloads, and its tokenizer must be
byte-identical everywhere. The text is produced from a seeded `random.Random` using only `choice`,
`randrange` and `random`, whose streams Python keeps stable across versions, so every interpreter yields
the same corpus. It mixes English-like prose, pseudo-words, Python-like code, JSON, chat turns and some
non-ASCII text so that the learned merges look like those of a real byte-level BPE.
"""

from __future__ import annotations

import random

_SEED = 20240611
_TARGET_BYTES = 450_000


def _split(text: str, sep: str = " ") -> tuple[str, ...]:
    return tuple(text.split(sep))


# Common English words, function words included; written as text to keep the list compact.
_WORDS = _split(
    "the of and to a in is it you that he was for on are with as I his they be at one have this from or "
    "had by not word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long make thing "
    "see him two has look more day could go come did number sound no most people my over know water than "
    "call first who may down side been now find any new work part take get place made live where after "
    "back little only round man year came show every good me give our under name very through just form "
    "sentence great think say help low line differ turn cause much mean before move right boy old too same "
    "tell does set three want air well also play small end put home read hand port large spell add even "
    "land here must big high such follow act why ask men change went light kind off need house picture try "
    "us again animal point mother world near build self earth father head stand own page should country "
    "found answer school grow study still learn plant cover food sun four between state keep eye never last "
    "let thought city tree cross farm hard start might story saw far sea draw left late run while press "
    "close night real life few north open seem together next white children begin got walk example ease "
    "paper group always music those both mark often letter until mile river car feet care second book "
    "carry took science eat room friend began idea fish mountain stop once base hear horse cut sure watch "
    "color face wood main enough plain girl usual young ready above ever red list though feel talk bird soon "
    "body dog family direct pose leave song measure door product black short numeral class wind question"
)
_NAMES = _split("Alice Bob Carol Dmitri Elena Farid Grace Hiro Ines Jonas Kwame")
_NON_ASCII = _split(
    "café|naïve|résumé|élève|über|Müller|grüß|Straße|Fußball|señor|año|São Paulo|Zürich|Ångström|"
    "中文|你好|世界|模型|日本語|こんにちは|привет|мир|Ελλάδα|😀|🚀|✨|👍|🙂|→|≤|€|°C",
    sep="|",
)

_ONSETS = _split("|b|br|c|ch|d|dr|f|fl|g|gr|h|j|k|l|m|n|p|pl|qu|r|s|sh|st|str|t|th|tr|v|w|z", sep="|")
_NUCLEI = _split("a e i o u ai ea ee io oo ou y")
_CODAS = _split("|||n|r|s|t|l|m|nd|ng|st|rk|x|ck", sep="|")  # empty codas weighted 3x

_CODE_NAMES = _split(
    "x y i n data value result items config model tokens batch self state path count total index cache "
    "request output logits"
)
_CODE_FUNCS = _split(
    "len range print sorted sum max min list dict enumerate zip isinstance str int float open append get "
    "update forward encode"
)
_JSON_KEYS = _split(
    "id name type value items count enabled tags model role content score created_at user status max_tokens "
    "temperature stop text"
)
_ROLES = ("user", "assistant", "system")


def _pseudo_word(rng: random.Random) -> str:
    syllables = rng.randrange(1, 4)
    return "".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS) for _ in range(syllables))


def _number(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        return str(rng.randrange(100))
    if kind == 1:
        return str(rng.randrange(100_000))
    if kind == 2:
        return f"{rng.random() * 1000:.2f}"
    return f"{rng.randrange(1900, 2100)}-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}"


def _word(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.78:
        return rng.choice(_WORDS)
    if r < 0.88:
        return _pseudo_word(rng)
    if r < 0.94:
        return _number(rng)
    if r < 0.97:
        return rng.choice(_NAMES)
    return rng.choice(_NON_ASCII)


def _sentence(rng: random.Random) -> str:
    words = [_word(rng) for _ in range(rng.randrange(4, 16))]
    words[0] = words[0][:1].upper() + words[0][1:]
    if len(words) > 6 and rng.random() < 0.4:
        words[rng.randrange(2, len(words) - 2)] += rng.choice((",", ",", ";", ":"))
    if rng.random() < 0.1:
        i = rng.randrange(len(words))
        words[i] = '"' + words[i] + '"'
    if rng.random() < 0.05:
        i = rng.randrange(len(words))
        words[i] = "(" + words[i] + ")"
    return " ".join(words) + rng.choice((".", ".", ".", ".", "!", "?"))


def _paragraph(rng: random.Random) -> str:
    return " ".join(_sentence(rng) for _ in range(rng.randrange(1, 5)))


def _expr(rng: random.Random) -> str:
    r = rng.randrange(5)
    if r == 0:
        return rng.choice(_CODE_NAMES)
    if r == 1:
        return str(rng.randrange(1000))
    if r == 2:
        return f"{rng.choice(_CODE_FUNCS)}({rng.choice(_CODE_NAMES)})"
    if r == 3:
        return f"{rng.choice(_CODE_NAMES)}[{rng.choice(_CODE_NAMES)}]"
    return f"{rng.choice(_CODE_NAMES)} {rng.choice(('+', '-', '*', '//', '%'))} {rng.randrange(1, 64)}"


def _code_line(rng: random.Random) -> str:
    name = lambda: rng.choice(_CODE_NAMES)  # lazy: only the chosen template draws names
    templates = (
        lambda: f"{name()} = {_expr(rng)}",
        lambda: f"def {_pseudo_word(rng)}_{name()}({name()}, {name()}=None):",
        lambda: f"for {name()} in {rng.choice(('range', 'enumerate', 'sorted'))}({name()}):",
        lambda: f"if {name()} is not None and {_expr(rng)} > {rng.randrange(10)}:",
        lambda: f"return {_expr(rng)}",
        lambda: f"{name()}.{rng.choice(_CODE_FUNCS)}({_expr(rng)})",
        lambda: f"class {_pseudo_word(rng).capitalize()}{rng.choice(('Config', 'Model', 'Cache', 'Error'))}:",
        lambda: f"import {rng.choice(('os', 'json', 'math', 'torch', 'numpy as np', 'typing'))}",
        lambda: f'print(f"{{{name()}}}: {{{name()}!r}}")',
        lambda: f"# {_sentence(rng)}",
        lambda: f'{name()}: dict[str, int] = {{"{rng.choice(_JSON_KEYS)}": {rng.randrange(100)}}}',
        lambda: f'raise ValueError("{_sentence(rng)}")',
        lambda: "else:",
        lambda: "pass",
    )
    indent = "    " * rng.randrange(3)
    return indent + rng.choice(templates)()


def _json_string(rng: random.Random) -> str:
    kind = rng.randrange(4)
    s = _pseudo_word(rng) if kind == 0 else rng.choice((_WORDS, _NAMES, _NON_ASCII)[kind - 1])
    return '"' + s + '"'


def _json_value(rng: random.Random, depth: int) -> str:
    r = rng.randrange(9 if depth < 2 else 7)
    if r == 0:
        return str(rng.randrange(-100, 10_000))
    if r == 1:
        return f"{rng.random():.3f}"
    if r in (2, 3):
        return _json_string(rng)
    if r == 4:
        return rng.choice(("true", "false"))
    if r == 5:
        return "null"
    if r == 6:
        return "[" + ", ".join(_json_string(rng) for _ in range(rng.randrange(4))) + "]"
    if r == 7:
        return "[" + ", ".join(_json_value(rng, depth + 1) for _ in range(rng.randrange(1, 4))) + "]"
    return _json_object(rng, depth + 1)


def _json_object(rng: random.Random, depth: int = 0) -> str:
    n = rng.randrange(1, 6)
    pairs = ('"' + rng.choice(_JSON_KEYS) + '": ' + _json_value(rng, depth) for _ in range(n))
    return "{" + ", ".join(pairs) + "}"


def _chat(rng: random.Random) -> str:
    turns = []
    for _ in range(rng.randrange(1, 4)):
        speaker = rng.choice(("User", "Assistant", "user", "assistant", "System"))
        turns.append(f"{speaker}: {_paragraph(rng)}")
    if rng.random() < 0.3:
        turns.append(f'{{"role": "{rng.choice(_ROLES)}", "content": "{_sentence(rng)}"}}')
    return "\n".join(turns)


def corpus_lines() -> list[str]:
    """Return the fixed training corpus (about 450 KB of UTF-8), identical on every Python 3 version."""
    rng = random.Random(_SEED)
    makers = (_paragraph, _paragraph, _paragraph, _code_line, _code_line, _json_object, _chat)
    lines: list[str] = []
    size = 0
    while size < _TARGET_BYTES:
        line = rng.choice(makers)(rng)
        lines.append(line)
        size += len(line.encode("utf-8")) + 1
    return lines
