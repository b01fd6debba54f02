"""The inferlet SDK: write ``async def main(input)`` against these and run it with ``pie run``."""

from inferlet import chat, mcp, messaging, reasoning, runtime, session, tools
from inferlet.context import Context
from inferlet.forward import Forward, Output, ProbeHandle, SampleHandle
from inferlet.generator import Generator, GenStep
from inferlet.model import Model
from inferlet.sampler import Distribution, Entropy, Logits, Logprob, Logprobs, Sampler
from inferlet.tokenizer import Tokenizer

__all__ = [
    "Context",
    "Distribution",
    "Entropy",
    "Forward",
    "GenStep",
    "Generator",
    "Logits",
    "Logprob",
    "Logprobs",
    "Model",
    "Output",
    "ProbeHandle",
    "SampleHandle",
    "Sampler",
    "Tokenizer",
    "chat",
    "mcp",
    "messaging",
    "reasoning",
    "runtime",
    "session",
    "tools",
]
