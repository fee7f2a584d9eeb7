"""Structured output (`jspec.constraints`): constraints compiled to automata over the
tokenizer's vocabulary, run as device tables inside the loop.

- The tables' lookups (allowed tokens, next states) equal the automaton's transitions.
- Constrained output is valid (it matches the regex, the JSON parses and has the schema's
  keys) and ends as "stop" when the constraint is complete; a batch mixes every kind
  and free rows.
- Constrained greedy speculation equals constrained greedy plain decoding token for
  token: EAGLE, EAGLE-3, standalone and n-gram drafts, chains and trees, dense and paged;
  seeded sampling the same.
- The sampled distribution at a round's node is the target's masked, renormalised
  distribution (a chi-square test that rejects a wrong mask).
- Bad input: invalid regexes and schemas, unsupported schema features, an empty language,
  no tokenizer, a program compiled without constraints.
"""
from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.constraints import compile_constraint
from jspec.constraints import tables as gt
from conftest import CACHES
from test_sampling_exact import chi_square_p

pytest.importorskip("outlines_core")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"enum": [1, 22, 333]}, "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"]}
PROMPTS = ["def add(a, b):", "x = ", "The answer is", "{", "import os\n"]
KINDS = [jspec.Regex(r"(ab|cd)+e{2,4}"), jspec.JsonSchema(SCHEMA), jspec.Choice(["yes", "no", "maybe so"]),
         None, jspec.Regex(r"[0-9]{2,3}-[a-z]{3}")]  # one per prompt: every kind and a free row


def valid(constraint, text: str) -> bool:
    if constraint is None:
        return True
    if isinstance(constraint, jspec.JsonSchema):
        value = json.loads(text)
        return set(value) == {"name", "n", "ok"} and isinstance(value["n"], int) and isinstance(value["ok"], bool)
    return re.fullmatch(constraint.regex(), text) is not None


def test_tables_equal_the_automaton(target):
    """Every transition and allowed set of three automata packed together (and FREE, state
    0: every token, never left) as the device looks them up."""
    automata = [compile_constraint(c, target.tokenizer, target.config.vocab_size) for c in KINDS if c is not None]
    Q, E = gt.capacity(automata)
    host, offsets = gt.pack(automata, Q, E, target.config.vocab_size)
    tables = jax.tree.map(jnp.asarray, host)
    qs, ts, want = [0, 0], [5, 200], [0, 0]
    for a in automata:
        o = offsets[a.key]
        for q, tr in enumerate(a.transitions):
            qs += [o + q] * len(tr)
            ts += list(tr)
            want += [o + n for n in tr.values()]
        mask = np.asarray(gt.allowed_mask(tables, jnp.arange(o, o + a.num_states), target.config.vocab_size))
        assert [set(np.nonzero(m)[0]) for m in mask] == [set(tr) for tr in a.transitions]
        assert (np.asarray(tables.terminal[o:o + a.num_states]) == a.terminal).all()
    assert np.asarray(gt.next_state(tables, jnp.array(qs), jnp.array(ts))).tolist() == want
    assert np.asarray(gt.allowed_mask(tables, jnp.array([0]), target.config.vocab_size)).all()
    assert compile_constraint(KINDS[0], target.tokenizer, target.config.vocab_size) is automata[0]  # cached


@pytest.mark.parametrize("kind,spec,cache", [
    ("plain", None, "paged16"),
    ("eagle3", (3, 1, 4), "paged16"),
    ("eagle3", (3, 2, 6), "dense"),
    ("eagle", (2, 1, 3), "dense"),
    ("standalone", (3, 2, 5), "paged16"),
    ("ngram", (4, 1, 5), "dense"),
    ("dflash", None, "dense"),  # the block's chain, its nodes' states from the proposer
    ("dflash", dict(num_steps=5, verify_lengths=(2,), verify_costs=(1.0, 1.1), survival_power=0.5), "paged16"),
])
def test_constrained_speculation_equals_plain(target, with_draft, kind, spec, cache):
    """A batch of every constraint kind and a free row: speculative greedy output equals
    plain greedy output under the same constraints, token for token, and is valid."""
    params = {"plain": target, "ngram": target.with_draft(jspec.NgramDraft())}.get(kind) or with_draft(kind)
    plain = _plain(target)
    sc = None if spec is None else jspec.SpecConfig(**spec) if isinstance(spec, dict) else jspec.SpecConfig(*spec)
    out = jspec.generate(params, PROMPTS, max_new_tokens=64, stop_token_ids=[], constraint=KINDS, spec=sc,
                         cache=CACHES[cache])
    assert out.tokens == plain.tokens
    for c, text, reason in zip(KINDS, out.text, out.finish_reasons):
        if reason == "stop":
            assert valid(c, text), (c, text)
    assert out.finish_reasons[2] == "stop" and out.text[2] in ("yes", "no", "maybe so")


_PLAIN = {}


def _plain(target):
    if "greedy" not in _PLAIN:
        _PLAIN["greedy"] = jspec.generate(target, PROMPTS, max_new_tokens=64, stop_token_ids=[], constraint=KINDS)
    return _PLAIN["greedy"]


def test_plain_constrained_output_is_valid_and_stops(target):
    """Plain decoding under each constraint: complete outputs are valid and end as "stop"
    at the token that completes them (no EOS needed: the stop ids are empty)."""
    out = _plain(target)
    free = jspec.generate(target, PROMPTS[3], max_new_tokens=64, stop_token_ids=[])
    assert out.tokens[3] == free.tokens  # the free row is untouched by its neighbours' constraints
    assert out.finish_reasons[:3] == ["stop"] * 3 and out.finish_reasons[3] == "length"
    for c, text, reason in zip(KINDS, out.text, out.finish_reasons):
        if reason == "stop":
            assert valid(c, text), (c, text)


def test_seeded_sampling_equals_plain(target, with_draft):
    """Seeded constrained speculative sampling (EAGLE-3 chain) gives seeded constrained
    plain sampling's tokens."""
    kw = dict(max_new_tokens=32, stop_token_ids=[], constraint=KINDS, temperature=0.9, seed=[1, 2, 3, 4, 5])
    want = jspec.generate(target, PROMPTS, **kw)
    got = jspec.generate(with_draft("eagle3"), PROMPTS, spec=jspec.SpecConfig(3, 1, 4), **kw)
    assert got.tokens == want.tokens
    for c, text, reason in zip(KINDS, got.text, got.finish_reasons):
        if reason == "stop":
            assert valid(c, text), (c, text)


def test_sampled_distribution_is_the_masked_target(target, with_draft):
    """The constraint 'x[a-h]': the first token is 'x'; the second comes from a round's
    root node (EAGLE-3 chain, temperature 1). Over 2,048 seeded draws its distribution is
    the target's softmax at that position restricted to 'a'..'h' and renormalised (chi-
    square, p > 1e-3); the same counts reject the distribution masked to 'b'..'i'."""
    prompt = "def add(a, b):"
    tok = target.tokenizer
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    letters = [tok.convert_tokens_to_ids(ch) for ch in "abcdefghi"]
    x = tok.convert_tokens_to_ids("x")
    logits = np.asarray(jspec.logits(target, [ids + [x]]))[0, -1].astype(np.float64)

    def masked(allowed):
        p = np.exp(logits[allowed] - logits[allowed].max())
        return p / p.sum()
    prog = jspec.compile(with_draft("eagle3"), [prompt] * 64, max_new_tokens=2, stop_token_ids=[],
                         constraint=jspec.Regex("x[a-h]"), temperature=1.0, spec=jspec.SpecConfig(3, 1, 4))
    counts = np.zeros(8)
    for run in range(32):
        out = prog.run(seed=list(range(run * 64, run * 64 + 64)))
        for t in out.tokens:
            assert t[0] == x and t[1] in letters[:8]
            counts[letters.index(t[1])] += 1

    assert chi_square_p(counts, masked(letters[:8])) > 1e-3
    assert chi_square_p(counts, masked(letters[1:9])) < 1e-6


def test_compiled_run_and_stream_take_constraints(target):
    """`compile().run` with other constraints than compiled (tables of more states: a
    new plan, once), and `stream`, whose chunks concatenate to `generate`'s tokens."""
    prog = jspec.compile(target, PROMPTS[:2], max_new_tokens=24, stop_token_ids=[],
                         constraint=jspec.Choice(["yes", "no"]))
    assert prog.run().text == jspec.generate(target, PROMPTS[:2], max_new_tokens=24, stop_token_ids=[],
                                             constraint=jspec.Choice(["yes", "no"])).text
    out = prog.run(constraint=[jspec.JsonSchema(SCHEMA), None])
    want = jspec.generate(target, PROMPTS[:2], max_new_tokens=24, stop_token_ids=[],
                          constraint=[jspec.JsonSchema(SCHEMA), None])
    assert out.tokens == want.tokens
    chunks = list(jspec.stream(target, PROMPTS[:2], max_new_tokens=24, stop_token_ids=[],
                               constraint=[jspec.JsonSchema(SCHEMA), None], rounds_per_chunk=3))
    assert [sum((c.tokens[i] for c in chunks), []) for i in range(2)] == want.tokens


def test_bad_constraints_get_clear_errors(target):
    with pytest.raises(ValueError, match="Regex: invalid pattern"):
        jspec.Regex("a(b")
    with pytest.raises(ValueError, match="Unsupported type: nonsense"):
        jspec.generate(target, "x", constraint=jspec.JsonSchema({"type": "nonsense"}))
    with pytest.raises(ValueError, match="Format hostname-x is not supported"):
        jspec.generate(target, "x", constraint=jspec.JsonSchema({"type": "string", "format": "hostname-x"}))
    with pytest.raises(ValueError, match="Choice: options"):
        jspec.Choice([])
    with pytest.raises(ValueError, match="no transitions"):  # an empty language: nothing can start it
        jspec.generate(target, "x", constraint=jspec.Regex(r"[^\s\S]"))
    with pytest.raises(TypeError, match="constraint must be a jspec.JsonSchema"):
        jspec.generate(target, "x", constraint="json")
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        jspec.generate(dataclasses.replace(target, tokenizer=None), [5, 6], constraint=jspec.Choice(["a"]))
    prog = jspec.compile(target, [[5, 6]], max_new_tokens=4)
    with pytest.raises(ValueError, match="constraints \\(it was compiled without any\\)"):
        prog.inputs(constraint=jspec.Choice(["a"]))


def test_engine_serves_constrained_requests(target, with_draft):
    """The serving engine (EAGLE-3 chain, paged, 2 rows) with constrained and free requests
    submitted at once: each equals `generate`'s constrained output; the tables hold the
    automata placed as requests are admitted (an automaton asked again is placed once); a
    request whose automaton could never fit the tables, or sent to an engine without
    tables, is refused at submit."""
    params = with_draft("eagle3")
    engine = jspec.Engine(params, max_batch=2, max_prompt_len=16, max_new_tokens=64, rounds_per_chunk=2,
                          constraint_states=256)
    handles = [engine.submit(p, max_new_tokens=64, stop_token_ids=[], constraint=c) for p, c in zip(PROMPTS, KINDS)]
    handles.append(engine.submit(PROMPTS[0], max_new_tokens=64, stop_token_ids=[], constraint=KINDS[1]))
    while engine.step():
        pass
    want = _plain(target).tokens + [jspec.generate(target, PROMPTS[0], max_new_tokens=64, stop_token_ids=[],
                                                   constraint=KINDS[1]).tokens]
    assert [h.result().tokens for h in handles] == want
    assert [h.result().finish_reason for h in handles[:3]] == ["stop"] * 3
    assert len(engine.runner.slots.placed) == 4
    with pytest.raises(ValueError, match="the engine's tables hold 255"):
        engine.submit("x", constraint=jspec.Json())
    plain_engine = jspec.Engine(target, max_batch=1, max_prompt_len=16, max_new_tokens=8)
    with pytest.raises(ValueError, match="this engine takes no constraints"):
        plain_engine.submit("x", max_new_tokens=4, constraint=KINDS[2])


def test_preempted_constrained_requests_resume_exactly(target):
    """A pool of 7 pages of 16 tokens under 2 rows: constrained requests are preempted and
    resume with their constraint's state walked over their output so far; each equals
    `generate`'s constrained output."""
    engine = jspec.Engine(target, max_batch=2, max_prompt_len=16, max_new_tokens=64, rounds_per_chunk=2,
                          cache=jspec.CacheConfig("paged", page_size=16, num_pages=7), constraint_states=256)
    order = [3, 1, 3, 0, 1, 2, 4]  # free rows of 65 tokens (5 pages) beside constrained ones
    handles = [engine.submit(PROMPTS[i], max_new_tokens=64, stop_token_ids=[], constraint=KINDS[i]) for i in order]
    while engine.step():
        pass
    assert [h.result().tokens for h in handles] == [_plain(target).tokens[i] for i in order]
    assert engine.stats.num_preemptions > 0


def test_engine_tables_placed_first_fit_in_place(target):
    """The engine's placement (`jspec.serve.grammar.ConstraintSlots`) over tables exactly as
    large as three automata: they take first-fit ranges; a fourth drops the one no row holds
    and fills its gap, in front of the held ones, without touching them; the rows written
    in place (`write_rows`, chunks of 8 states and 64 exceptions) leave the device's tables
    equal to the host's copy, whose lookups equal every placed automaton's transitions."""
    from jspec.serve.grammar import ConstraintSlots
    V = target.config.vocab_size
    compile_ = lambda c: compile_constraint(c, target.tokenizer, V)  # noqa: E731
    a, b, c, d = (compile_(jspec.Choice(["ab", "cd"])), compile_(jspec.Choice(["xyz", "w"])),
                  compile_(jspec.Regex(r"[a-f]{3,20}")), compile_(jspec.Choice(["q"])))
    assert d.num_states <= a.num_states
    Q = 1 + a.num_states + b.num_states + c.num_states
    slots = ConstraintSlots(Q, 4096, V)
    device = gt.free_tables(Q, 4096, V)

    def sync():
        nonlocal device
        for rows in slots.take_rows(8, 64):
            device = gt.write_rows(device, jax.tree.map(jnp.asarray, rows))
        for got, want in zip(jax.tree.leaves(device), jax.tree.leaves(slots.host)):
            np.testing.assert_array_equal(np.asarray(got), want)

    def check(automaton, offset):
        qs, ts, want = [], [], []
        for q, tr in enumerate(automaton.transitions):
            qs += [offset + q] * len(tr)
            ts += list(tr)
            want += [offset + n for n in tr.values()]
        assert np.asarray(gt.next_state(device, jnp.array(qs), jnp.array(ts))).tolist() == want
    placed = slots.place([a, b, c], held=set())
    sync()
    assert [placed[x.key] for x in (a, b, c)] == [1, 1 + a.num_states, 1 + a.num_states + b.num_states]
    placed = slots.place([d], held={b.key, c.key})  # full: `a` (held by no row) is dropped
    sync()
    assert a.key not in placed and placed[d.key] == 1
    for x in (b, c, d):
        check(x, placed[x.key])
    with pytest.raises(ValueError, match="full with the constraints of running requests"):
        slots.place([a], held={b.key, c.key, d.key})


def test_logprobs_stay_the_targets_raw_ones(target, with_draft):
    """Under a constraint the reported logprobs are the target's raw log-softmax (vLLM's
    default), not the masked distribution's: equal to `jspec.logits` at each position, and
    the top alternatives include tokens the constraint forbids (EAGLE-3 chain)."""
    prompt = target.tokenizer("def add(a, b):", add_special_tokens=False)["input_ids"]
    out = jspec.generate(with_draft("eagle3"), [prompt], max_new_tokens=12, stop_token_ids=[], logprobs=3,
                         constraint=jspec.Regex("[a-e]{4,12}"), spec=jspec.SpecConfig(3, 1, 4))
    tokens = out.tokens[0]
    raw = np.asarray(jspec.logits(target, [prompt + tokens]))[0, len(prompt) - 1:-1]
    logp = raw - np.log(np.exp(raw - raw.max(-1, keepdims=True)).sum(-1, keepdims=True)) - raw.max(-1, keepdims=True)
    got = [lp.logprob for lp in out.logprobs[0]]
    np.testing.assert_allclose(got, [logp[i, t] for i, t in enumerate(tokens)], atol=2e-5)
    letters = set(target.tokenizer.convert_tokens_to_ids(list("abcde")))
    assert any(tid not in letters for lp in out.logprobs[0] for tid, _ in lp.top)
