"""Constraint compilers side by side (CPU work; any machine): outlines-core (what
`jspec.constraints` uses), xgrammar and llguidance, on five function-calling schemas and
any JSON object, over one tokenizer.

For each schema and library: the compile time (median of --reps fresh compiles, no cache):
outlines-core's token-level `Index` (the whole automaton, every state's transitions);
xgrammar's `GrammarCompiler.compile_json_schema` (its grammar and the token masks it
precomputes); llguidance's matcher built and its first mask computed (it computes masks
as it goes). For jspec also the automaton's states, the exceptions its tables keep, the
device tables' bytes at this vocabulary (`jspec.constraints.tables`), and the packing time.
Then which schema features each library accepts (`FEATURES`).

The tokenizer: --tokenizer DIR, or a byte-level BPE of --vocab tokens trained on the
Python sources of the installed packages (cached under /tmp; no hub needed).

    PYTHONPATH=. python3 benchmarks/constraints.py [--vocab 32000 | --tokenizer DIR] [--reps 3]
Result: $OUT/constraints_compile.json
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import site
import statistics
import time

from benchmarks.common import env_info, save_json

SCHEMAS = {
    "get_weather": {"type": "object", "properties": {
        "location": {"type": "string", "description": "city and country"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location", "unit"],
        "additionalProperties": False},
    "search_flights": {"type": "object", "properties": {
        "origin": {"type": "string", "minLength": 3, "maxLength": 3},
        "destination": {"type": "string", "minLength": 3, "maxLength": 3},
        "date": {"type": "string", "format": "date"}, "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
        "cabin": {"type": "string", "enum": ["economy", "premium", "business", "first"]}},
        "required": ["origin", "destination", "date", "passengers"], "additionalProperties": False},
    "create_event": {"type": "object", "properties": {
        "title": {"type": "string"}, "start": {"type": "string", "format": "date-time"},
        "duration_minutes": {"type": "integer"}, "attendees": {"type": "array", "items": {
            "type": "object", "properties": {"email": {"type": "string"}, "optional": {"type": "boolean"}},
            "required": ["email"]}}, "reminder": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
        "required": ["title", "start", "duration_minutes", "attendees"]},
    "send_email": {"type": "object", "properties": {
        "to": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5},
        "subject": {"type": "string"}, "body": {"type": "string"},
        "priority": {"type": "string", "enum": ["low", "normal", "high"]}},
        "required": ["to", "subject", "body"]},
    "run_sql": {"type": "object", "properties": {
        "database": {"type": "string", "enum": ["sales", "inventory", "users"]},
        "query": {"type": "string"}, "params": {"type": "array", "items": {
            "anyOf": [{"type": "string"}, {"type": "number"}, {"type": "boolean"}]}},
        "limit": {"type": "integer"}}, "required": ["database", "query"]},
    "any_object": {"type": "object"},
}

FEATURES = {  # a schema feature -> a small schema using it
    "enum": {"enum": ["a", "b"]},
    "const": {"const": "x"},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}]},
    "$ref": {"$defs": {"p": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/p"}}},
    "recursive $ref": {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}},
                       "$ref": "#/$defs/n"},
    "pattern": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
    "format: date-time": {"type": "string", "format": "date-time"},
    "format: email": {"type": "string", "format": "email"},
    "minLength/maxLength": {"type": "string", "minLength": 2, "maxLength": 8},
    "minItems/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "minimum/maximum": {"type": "integer", "minimum": 3, "maximum": 300},
    "additionalProperties: schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "patternProperties": {"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
    "type list": {"type": ["string", "null"]},
}


def trained_tokenizer(vocab: int):
    """A byte-level BPE of `vocab` tokens trained on installed Python sources (cached)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    path = f"/tmp/jspec-bpe-{vocab}"
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        files = sorted(glob.glob(os.path.join(site.getsitepackages()[0], "**", "*.py"), recursive=True))[:20000]
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train(files, trainer)
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
        fast.save_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path)


def timed(fn, reps: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def outlines_row(schema: dict, tokenizer, vocab: int, reps: int) -> dict:
    import numpy as np  # noqa: F401
    import jspec
    from jspec.constraints import automaton as am
    from jspec.constraints import tables as gt
    constraint = jspec.JsonSchema(schema)

    def build():
        am.clear_cache()
        gt.exceptions.cache_clear()
        return am.compile_constraint(constraint, tokenizer, vocab)
    seconds, a = timed(build, reps)
    Q, E = gt.capacity([a])
    pack_s, _ = timed(lambda: gt.pack([a], Q, E, vocab), 1)
    W = -(-vocab // 32)
    return {"compile_s": seconds, "states": a.num_states, "transitions": a.edges(), "exceptions": gt.needs(a)[1],
            "capacity": [Q, E], "table_bytes": 4 * (Q * (W + 4) + 2 * E), "pack_s": pack_s}


def xgrammar_row(schema: dict, tokenizer, vocab: int, reps: int) -> dict:
    import xgrammar as xgr
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    text = json.dumps(schema)

    def build():
        return xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(text)
    seconds, _ = timed(build, reps)
    return {"compile_s": seconds}


def llguidance_row(schema: dict, tokenizer, vocab: int, reps: int) -> dict:
    import llguidance
    import llguidance.hf
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))

    def build():
        m = llguidance.LLMatcher(lltok, grammar)
        m.compute_bitmask()
        if m.is_error():
            raise ValueError(m.get_error())
        return m
    seconds, _ = timed(build, reps)
    return {"compile_s": seconds}


LIBRARIES = {"outlines-core (jspec)": outlines_row, "xgrammar": xgrammar_row, "llguidance": llguidance_row}


def attempt(fn, *args) -> dict:
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 (a library refusing a schema is a result)
        return {"error": f"{type(err).__name__}: {str(err)[:160]}"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    t0 = time.perf_counter()
    tokenizer = trained_tokenizer(args.vocab) if args.tokenizer is None else \
        __import__("transformers").AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = len(tokenizer)
    res = {"env": env_info(), "vocab": vocab, "tokenizer_s": time.perf_counter() - t0, "schemas": {}, "features": {}}
    print(res["env"], "vocab", vocab, flush=True)
    for name, schema in SCHEMAS.items():
        res["schemas"][name] = {lib: attempt(fn, schema, tokenizer, vocab, args.reps) for lib, fn in LIBRARIES.items()}
        print(name, json.dumps(res["schemas"][name], default=str)[:600], flush=True)
        save_json("constraints_compile.json", res)
    for name, schema in FEATURES.items():
        res["features"][name] = {lib: "error" not in attempt(fn, schema, tokenizer, vocab, 1)
                                 for lib, fn in LIBRARIES.items()}
        print(name, res["features"][name], flush=True)
    print("saved", save_json("constraints_compile.json", res))


if __name__ == "__main__":
    main()
