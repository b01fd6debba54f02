"""A swarm over the message bus: a pipeline of agents, each a separate inferlet, handing work down the line.

Launch one inferlet per stage (any nodes), then feed the first stage's topic, e.g. with pie submit:

    pie submit -d examples/swarm.py -- --role stage --stage 0 --stages 3 --items 4
    pie submit -d examples/swarm.py -- --role stage --stage 1 --stages 3 --items 4
    pie submit -d examples/swarm.py -- --role stage --stage 2 --stages 3 --items 4
    pie submit examples/swarm.py -- --role source --stages 3 --items 4

Each stage pulls an item from its topic (``swarm-<stage>``; push/pull delivers each message exactly once, in order),
has the model add a short contribution to it, and pushes the result to the next stage's topic; the last stage
pushes to ``swarm-done``. The source pushes the items and collects what comes out of the far end. The text of the
item travels inside the message: the inferlet that receives it builds its own context from it, as agents handing
work to one another do.
"""

import json

from inferlet import Context, Model, Sampler, messaging, runtime


def topic(prefix: str, stage: int | str) -> str:
    return f"{prefix}-{stage}"


async def stage(input: dict) -> dict:
    model = Model.load(runtime.models()[0])
    index, stages, items = int(input["stage"]), int(input["stages"]), int(input["items"])
    prefix, max_tokens = input.get("prefix", "swarm"), int(input.get("max_tokens", 4))
    out = topic(prefix, index + 1) if index + 1 < stages else topic(prefix, "done")
    handled = []
    for _ in range(items):
        item = json.loads(await messaging.pull(topic(prefix, index)))
        with Context(model) as ctx:
            ctx.system(f"You are agent {index} of a pipeline. Add one short remark.").user(item["text"])
            remark = await ctx.generate(Sampler.argmax(), max_tokens=max_tokens).collect_text()
        item["trail"].append(index)
        item["text"] += f"\n[agent {index}] {remark}"
        messaging.push(out, json.dumps(item))
        handled.append(item["id"])
    return {"stage": index, "handled": handled}


async def source(input: dict) -> dict:
    stages, items, prefix = int(input["stages"]), int(input["items"]), input.get("prefix", "swarm")
    for i in range(items):
        messaging.push(topic(prefix, 0), json.dumps({"id": i, "text": f"Task {i}: name a colour.", "trail": []}))
    done = [json.loads(await messaging.pull(topic(prefix, "done"))) for _ in range(items)]
    return {"stages": stages, "results": done}


async def main(input: dict) -> dict:
    return await (source if input.get("role") == "source" else stage)(input)
