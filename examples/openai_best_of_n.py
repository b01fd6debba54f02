"""Best-of-n behind the standard OpenAI API: a client names this program in its request and gets, as one ordinary
choice, the most likely of several sampled candidates (judged by mean token log-probability).

    pie upload examples/openai_best_of_n.py            # prints the program id
    client.chat.completions.create(model="default", messages=[...], temperature=0.8,
                                   extra_body={"inferlet": "<program id>"})

The input is the request the ingress validated (``completions.read_request`` reads it back); the answer goes back in
the built-in's shape, so streaming, usage and the response objects work unchanged. The candidates fork one prefilled
prompt, so its pages are computed once and shared.
"""

import asyncio

from inferlet import Context, Model, completions

CANDIDATES = 4


async def main(input: dict) -> dict:
    request = completions.read_request(input)
    model = Model.load(request.model)
    (tokens, _), *_ = completions.prompts(model, request)
    # The candidates report their tokens' log-probabilities to be judged, and nothing streams until one is chosen.
    candidate = request.with_alternatives(0).model_copy(update={"stream": False})
    base = Context(model)
    base.append(tokens[:-1])
    await base.flush()
    runs = [completions.run_choice(model, candidate, base.fork(), i, tokens[-1:]) for i in range(CANDIDATES)]
    base.release()
    choices = await asyncio.gather(*runs)

    def mean_logprob(choice: completions.Choice) -> float:
        return sum(e.logprob for e in choice.logprobs) / max(len(choice.logprobs), 1)

    best = max(choices, key=mean_logprob)
    best.index, best.logprobs = 0, best.logprobs if request.alternatives is not None else []
    usage = completions.Usage(prompt_tokens=len(tokens), completion_tokens=sum(c.completion_tokens for c in choices))
    return completions.Report(choices=[best], usage=usage).as_output()
