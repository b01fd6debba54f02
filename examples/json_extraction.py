"""Structured extraction: read a passage, return a JSON object that is guaranteed to match a schema.

pie run examples/json_extraction.py -- --text "Ada Lovelace, 36, lives in London." --temperature 0.7

The Generator is constrained by the schema (``collect_json(schema=...)``): every step's logit mask allows only
tokens that keep the output a valid prefix of a matching document, and the end-of-turn token only once it is
complete, so the reply always parses and validates, even from a model that has never seen JSON. Pass your own
``--schema`` (JSON text) to extract other fields.
"""

import json

from inferlet import Context, Model, Sampler, runtime

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,15}$"},
        "languages": {"type": "array", "items": {"enum": ["en", "fr", "de", "es"]}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "languages"],
}


async def main(input: dict) -> dict:
    model = Model.load(runtime.models()[0])
    schema = json.loads(input["schema"]) if "schema" in input else PERSON
    temperature = float(input.get("temperature", 0.0))
    sampler = Sampler.multinomial(temperature, int(input.get("seed", 0))) if temperature else Sampler.argmax()
    with Context(model) as ctx:
        ctx.system("Extract the fields as JSON matching this schema: " + json.dumps(schema))
        ctx.user(input.get("text", "Ada Lovelace, 36, lives in London and speaks English and French."))
        return await ctx.generate(sampler, max_tokens=int(input.get("max_tokens", 200))).collect_json(schema=schema)
