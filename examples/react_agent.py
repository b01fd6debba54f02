"""A ReAct agent with a tool: think, act, observe, in one context that keeps its KV cache across turns.

pie run examples/react_agent.py -- --question "What is 12 * 7 + 5?" --turns 3

Each turn the model writes a short thought, then an action line. The action is constrained by a regular expression
(``calculate(<a> <op> <b>)``), so it always parses, even from a model that has never seen the format. The tool
runs in the inferlet, next to the model. Its observation is appended as the next user message, so only the new
tokens are run on the next turn: the conversation so far stays in the KV cache. (Client-side orchestration would
send the whole conversation again each turn.)
"""

import operator
import re

from inferlet import Context, Model, Regex, Sampler, runtime

ACTION = r"calculate\(([1-9][0-9]{0,2}) ([-+*]) ([1-9][0-9]{0,2})\)"
OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def calculate(a: int, op: str, b: int) -> int:
    """The tool: integer arithmetic on two operands."""
    return OPERATORS[op](a, b)


async def main(input: dict) -> dict:
    model = Model.load(runtime.models()[0])
    tokenizer = model.tokenizer()
    turns, thought_tokens = int(input.get("turns", 3)), int(input.get("thought_tokens", 8))
    sampler = Sampler.multinomial(1.0, int(input.get("seed", 0)))
    steps = []
    with Context(model) as ctx:
        ctx.system("Answer with Thought, then Action: calculate(a op b). You will see the Observation.")
        ctx.user(input.get("question", "What is 12 * 7 + 5?"))
        for _ in range(turns):
            ctx.cue()
            thought = await ctx.generate(sampler, max_tokens=thought_tokens, stop=[]).collect_text()
            ctx.append(tokenizer.encode("\nAction: "))
            action = await ctx.generate(sampler, max_tokens=24, constrain=Regex(ACTION)).collect_text()
            ctx.seal()
            a, op, b = re.fullmatch(ACTION, action).groups()
            args = [int(a), op, int(b)]
            observation = calculate(*args)
            ctx.user(f"Observation: {observation}")
            steps.append({"thought": thought, "action": action, "args": args, "observation": observation})
        return {"steps": steps, "seq_len": ctx.seq_len, "pending": len(ctx.buffer())}
