"""The inferlet SDK: write ``async def main(input)`` against these and run it with ``pie run``."""

from inferlet import chat, mcp, messaging, reasoning, runtime, scheduling, session, spec, tools
from inferlet._failover import ContextLost
from inferlet.adapter import Adapter
from inferlet.constraints import AnyJson, Constraint, Ebnf, GrammarConstraint, JsonSchema, Regex, Schema
from inferlet.context import Context
from inferlet.forward import Forward, Output, ProbeHandle, SampleHandle
from inferlet.generator import Generator, GenStep
from inferlet.grammar import Grammar, Matcher
from inferlet.model import Model
from inferlet.runtime import QuotaExceeded, TokenBudgetExhausted
from inferlet.sampler import Distribution, Entropy, Logits, Logprob, Logprobs, Sampler
from inferlet.tokenizer import Tokenizer

__all__ = [
    "Adapter",
    "AnyJson",
    "Constraint",
    "Context",
    "ContextLost",
    "Distribution",
    "Ebnf",
    "Entropy",
    "Forward",
    "GenStep",
    "Generator",
    "Grammar",
    "GrammarConstraint",
    "JsonSchema",
    "Logits",
    "Logprob",
    "Logprobs",
    "Matcher",
    "Model",
    "Output",
    "ProbeHandle",
    "QuotaExceeded",
    "Regex",
    "SampleHandle",
    "Sampler",
    "Schema",
    "TokenBudgetExhausted",
    "Tokenizer",
    "chat",
    "mcp",
    "messaging",
    "reasoning",
    "runtime",
    "scheduling",
    "session",
    "spec",
    "tools",
]
