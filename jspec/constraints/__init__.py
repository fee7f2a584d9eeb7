"""Structured output: constraints a request's generated text must match, compiled to
token-level automata (`automaton`) and run on the device as tables inside the loop
(`tables`): the target's logits at every node of a round are masked with the state its
path reaches, and the accepted tokens advance the row's state.

    out = jspec.generate(params, prompt, constraint=jspec.JsonSchema({"type": "object", ...}))

The kinds (`kinds`): `JsonSchema(schema)`, `Json()` (any JSON object), `Regex(pattern)`
and `Choice([str, ...])`.
"""
from jspec.constraints.automaton import Automaton, compile_constraint
from jspec.constraints.kinds import Choice, Constraint, Json, JsonSchema, Regex

__all__ = ["Automaton", "Choice", "Constraint", "Json", "JsonSchema", "Regex", "compile_constraint"]
