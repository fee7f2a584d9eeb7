"""Requests on the host: checking what a caller passes (clear errors naming the argument,
before anything compiles) and packing checked requests into the arrays a compiled loop
admits (`jspec.loop.state.Admission`).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import secrets

import numpy as np

from jspec.config import CacheConfig, SpecConfig
from jspec.constraints import Constraint, compile_constraint
from jspec.constraints import tables as gt
from jspec.tuning import DEFAULT_TUNING, Tuning
from jspec.loop.plan import Plan, proposer_for, slot_limits
from jspec.loop.state import MAX_LOGPROBS, Admission, RequestRows
from jspec.params import Params
from jspec.sampling import NEUTRAL, SamplingParams, any_processing

# The sampling arguments: (type, check -> message or None); each is one value or one per
# prompt in `generate`, `compile`, `stream` and `Compiled.run`; left out: its neutral value.
SAMPLING_ARGS = {
    "temperature": (float, lambda v: None if math.isfinite(v) and v >= 0 else "must be finite and >= 0"),
    "top_k": (int, lambda v: None if v >= 0 else "must be >= 0"),
    "top_p": (float, lambda v: None if 0 < v <= 1 else "must be in (0, 1]"),
    "min_p": (float, lambda v: None if 0 <= v <= 1 else "must be in [0, 1]"),
    "repetition_penalty": (float, lambda v: None if math.isfinite(v) and v > 0 else "must be finite and > 0"),
    "presence_penalty": (float, lambda v: None if math.isfinite(v) else "must be finite"),
    "frequency_penalty": (float, lambda v: None if math.isfinite(v) else "must be finite"),
    "seed": (int, lambda v: None if 0 <= v < 2 ** 31 else "must be in [0, 2**31)"),
}
SEED_RANGE = 2 ** 31


def fresh_seed() -> int:
    """A random seed for a request that gave none (its sampling is then not reproducible)."""
    return secrets.randbelow(SEED_RANGE)


def check_logprobs(v, name: str):
    """None (off) or an int in [0, MAX_LOGPROBS]: how many alternatives to list."""
    if v is None:
        return None
    if not is_int(v):
        raise TypeError(f"{name} must be an int or None, got {v!r}")
    if not 0 <= v <= MAX_LOGPROBS:
        raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {v}")
    return int(v)


@dataclasses.dataclass(frozen=True)
class Requests:
    """Checked requests, one entry per prompt (host values)."""

    prompts: list  # token id lists
    is_batch: bool  # the caller passed a batch (outputs are lists)
    max_new: list
    sampling: dict  # SamplingParams field -> one value per prompt (seed: None where none was given)
    stop_ids: list  # one list of stop token ids per prompt
    min_tokens: list = None  # tokens generated before a stop id may be chosen (0: off)
    speculative: list = None  # drafts may be accepted (False: plain rounds for that request)
    logprobs: list = None  # alternatives listed with each generated token's logprob (None: no logprobs)
    prompt_logprobs: list = None  # the same for the prompt's tokens
    resumed: list = None  # the prompt's last tokens that are its output already (a preempted request; 0: none)
    constraint: list = None  # each request's constraint (`jspec.constraints`), None: unconstrained
    automata: list = None  # the constraints compiled for the tokenizer (None where none)

    def __post_init__(self):
        n = len(self.prompts)
        for name, default in (("min_tokens", 0), ("speculative", True), ("logprobs", None),
                              ("prompt_logprobs", None), ("resumed", 0), ("constraint", None), ("automata", None)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, [default] * n)

    @property
    def lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    @property
    def samples(self) -> bool:
        """Does some request sample, carry a penalty or bar stops (min_tokens): the
        processing steps of `Plan.sampling`?"""
        values = {k: np.asarray(v) for k, v in self.sampling.items() if k != "seed"}
        return any_processing(SamplingParams(**values, seed=None)) or any(m > 0 for m in self.min_tokens)

    @property
    def values(self) -> dict:
        """Every per-request value (sampling and options), one list each: what
        `check_requests` takes to check them again."""
        return {**self.sampling, "min_tokens": self.min_tokens, "speculative": self.speculative,
                "logprobs": self.logprobs, "prompt_logprobs": self.prompt_logprobs, "constraint": self.constraint}

    @property
    def grammar(self) -> tuple:
        """The capacities of the tables these requests' constraints need (`Plan.grammar`;
        (): none)."""
        automata = [a for a in self.automata if a is not None]
        return gt.capacity(automata) if automata else ()

    @property
    def wants_logprobs(self) -> bool:
        return any(k is not None for k in self.logprobs)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return any(k is not None for k in self.prompt_logprobs)

    def take(self, indices) -> "Requests":
        """The requests at `indices`, as a batch."""
        pick = lambda values: [values[i] for i in indices]  # noqa: E731
        return Requests(prompts=pick(self.prompts), is_batch=True, max_new=pick(self.max_new),
                        sampling={k: pick(v) for k, v in self.sampling.items()}, stop_ids=pick(self.stop_ids),
                        min_tokens=pick(self.min_tokens), speculative=pick(self.speculative),
                        logprobs=pick(self.logprobs), prompt_logprobs=pick(self.prompt_logprobs),
                        resumed=pick(self.resumed), constraint=pick(self.constraint), automata=pick(self.automata))

    @staticmethod
    def concat(parts: list["Requests"]) -> "Requests":
        """Several checked requests as one batch."""
        cat = lambda name: [v for p in parts for v in getattr(p, name)]  # noqa: E731
        return Requests(prompts=cat("prompts"), is_batch=True, max_new=cat("max_new"),
                        sampling={k: [v for p in parts for v in p.sampling[k]] for k in SAMPLING_ARGS},
                        stop_ids=cat("stop_ids"), min_tokens=cat("min_tokens"), speculative=cat("speculative"),
                        logprobs=cat("logprobs"), prompt_logprobs=cat("prompt_logprobs"), resumed=cat("resumed"),
                        constraint=cat("constraint"), automata=cat("automata"))


# ----------------------------------------------------------------------------- checks

def is_int(x) -> bool:
    return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_params(params) -> None:
    if not isinstance(params, Params):
        raise TypeError(f"params must be what jspec.load returns (jspec.Params), got {type(params).__name__}")


def token_list(seq, vocab: int, what: str) -> list[int]:
    """A sequence of token ids checked against the vocabulary."""
    if isinstance(seq, np.ndarray):
        if seq.ndim != 1 or not np.issubdtype(seq.dtype, np.integer):
            raise TypeError(f"{what} must be a 1-D integer array, got {seq.dtype} with shape {seq.shape}")
        seq = seq.tolist()
    if not isinstance(seq, (list, tuple)):
        raise TypeError(f"{what} must be a string or a list of token ids, got {type(seq).__name__}")
    if len(seq) == 0:
        raise ValueError(f"{what} is empty")
    if all(type(t) is int for t in seq) and 0 <= min(seq) and max(seq) < vocab:  # the common case, at C speed
        return list(seq)
    for t in seq:
        if not is_int(t):
            raise TypeError(f"{what} holds {t!r} ({type(t).__name__}); token ids must be ints")
        if not 0 <= t < vocab:
            raise ValueError(f"{what} holds token id {t}, outside the vocabulary [0, {vocab})")
    return [int(t) for t in seq]


def prompts(params: Params, prompt) -> tuple[list[list[int]], bool]:
    """A prompt or a batch (strings, token id lists or arrays) -> (token lists, was it a batch)."""
    V = params.config.vocab_size

    def encode(s: str, what: str) -> list[int]:
        if params.tokenizer is None:
            raise ValueError("a string prompt needs a tokenizer, and this model directory has none; "
                             "pass token ids instead")
        if not s:
            raise ValueError(f"{what} is an empty string")
        return token_list(list(params.tokenizer(s)["input_ids"]), V, what)

    if isinstance(prompt, str):
        return [encode(prompt, "prompt")], False
    if isinstance(prompt, np.ndarray) and prompt.ndim == 2:
        prompt = list(prompt)
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, (str, list, tuple, np.ndarray))
                                                            for p in prompt):
        out = []
        for i, p in enumerate(prompt):
            what = f"prompt[{i}]"
            out.append(encode(p, what) if isinstance(p, str) else token_list(p, V, what))
        return out, True
    if isinstance(prompt, (list, tuple, np.ndarray)):
        return [token_list(prompt, V, "prompt")], False
    raise TypeError(f"prompt must be a string, a list of token ids, or a list of either; got {type(prompt).__name__}")


def per_request(value, n: int, name: str, kind, check) -> list:
    """One value or one per prompt -> n checked values."""
    vals = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value] * n
    if len(vals) != n:
        raise ValueError(f"{name} has {len(vals)} entries for {n} prompts")
    out = []
    for v in vals:
        if kind is int and not is_int(v):
            raise TypeError(f"{name} must be an int (or one per prompt), got {v!r}")
        if kind is bool and not isinstance(v, (bool, np.bool_)):
            raise TypeError(f"{name} must be True or False (or one per prompt), got {v!r}")
        if kind is float and (isinstance(v, bool) or not isinstance(v, (numbers.Real, np.floating, np.integer))):
            raise TypeError(f"{name} must be a number (or one per prompt), got {v!r}")
        v = kind(v)
        msg = check(v)
        if msg:
            raise ValueError(f"{name} {msg}, got {v!r}")
        out.append(v)
    return out


def _id_list(ids, vocab: int, what: str) -> list[int]:
    if is_int(ids):
        ids = [ids]
    if not isinstance(ids, (list, tuple, set, np.ndarray)):
        raise TypeError(f"{what} must be a list of ints or None, got {type(ids).__name__}")
    out = []
    for t in ids:
        if not is_int(t):
            raise TypeError(f"{what} holds {t!r}; token ids must be ints")
        if not 0 <= t < vocab:
            raise ValueError(f"stop token id {t} is outside the vocabulary [0, {vocab})")
        out.append(int(t))
    return sorted(set(out))


def stop_ids(params: Params, stop_token_ids, n: int) -> list[list[int]]:
    """One stop list per prompt: None -> the model's EOS ids; a list of ints -> that list
    for every prompt; a list of n lists -> one per prompt."""
    V = params.config.vocab_size
    if stop_token_ids is None:
        ids = set(params.config.eos_token_ids)
        tok = params.tokenizer
        if tok is not None and getattr(tok, "eos_token_id", None) is not None:
            ids.add(int(tok.eos_token_id))
        return [sorted(i for i in ids if 0 <= i < V)] * n
    if isinstance(stop_token_ids, (list, tuple)) and stop_token_ids and all(
            isinstance(s, (list, tuple, set, np.ndarray)) for s in stop_token_ids):
        if len(stop_token_ids) != n:
            raise ValueError(f"stop_token_ids has {len(stop_token_ids)} lists for {n} prompts")
        return [_id_list(s, V, f"stop_token_ids[{i}]") for i, s in enumerate(stop_token_ids)]
    return [_id_list(stop_token_ids, V, "stop_token_ids")] * n


REQUEST_OPTIONS = ("min_tokens", "speculative", "logprobs", "prompt_logprobs", "constraint")  # per-request values beside sampling


def check_sampling_names(values: dict) -> None:
    unknown = sorted(set(values) - set(SAMPLING_ARGS) - set(REQUEST_OPTIONS))
    if unknown:
        raise TypeError(f"unexpected argument {unknown[0]!r}; the per-request arguments are "
                        f"{', '.join([*SAMPLING_ARGS, *REQUEST_OPTIONS])}")


def check_requests(params: Params, prompt, max_new_tokens, stop_token_ids, values: dict) -> Requests:
    """values: {name in SAMPLING_ARGS or REQUEST_OPTIONS: one value or one per prompt};
    missing sampling values are neutral, a missing seed is drawn afresh at every run
    (`pack`); the options default to min_tokens 0, speculative True, no logprobs."""
    check_sampling_names(values)
    token_lists, is_batch = prompts(params, prompt)
    n = len(token_lists)
    context = getattr(params.config, "max_position_embeddings", None)
    for i, p in enumerate(token_lists):
        if context and len(p) > context:
            raise ValueError(f"prompt{f'[{i}]' if is_batch else ''} has {len(p)} tokens, more than the model's "
                             f"context of {context} tokens (max_position_embeddings)")
    sampling = {}
    for name, (kind, check) in SAMPLING_ARGS.items():
        v = values.get(name)
        if name == "seed" and (v is None or isinstance(v, (list, tuple)) and any(s is None for s in v)):
            seeds = one_each(v, n, name)
            sampling[name] = [None if s is None else per_request(s, 1, name, kind, check)[0] for s in seeds]
            continue
        sampling[name] = per_request(NEUTRAL[name] if v is None else v, n, name, kind, check)
    option = lambda name, default: default if values.get(name) is None else values[name]  # noqa: E731
    max_new = per_request(max_new_tokens, n, "max_new_tokens", int, lambda v: "must be >= 1" if v < 1 else None)
    mins = per_request(option("min_tokens", 0), n, "min_tokens", int, lambda v: "must be >= 0" if v < 0 else None)
    spec = per_request(option("speculative", True), n, "speculative", bool, lambda v: None)
    for i, (lo, hi) in enumerate(zip(mins, max_new)):
        if lo > hi:
            raise ValueError(f"min_tokens={lo} is above max_new_tokens={hi}" + (f" (prompt {i})" if n > 1 else ""))
    constraints = one_each(values.get("constraint"), n, "constraint")
    for c in constraints:
        if c is not None and not isinstance(c, Constraint):
            raise TypeError(f"constraint must be a jspec.JsonSchema, Json, Regex or Choice (or one per prompt), "
                            f"got {type(c).__name__}")
    automata = [None if c is None else compile_constraint(c, params.tokenizer, params.config.vocab_size)
                for c in constraints]
    return Requests(prompts=token_lists, is_batch=is_batch, max_new=max_new, sampling=sampling,
                    stop_ids=stop_ids(params, stop_token_ids, n), min_tokens=mins, speculative=spec,
                    logprobs=[check_logprobs(v, "logprobs") for v in one_each(values.get("logprobs"), n, "logprobs")],
                    prompt_logprobs=[check_logprobs(v, "prompt_logprobs")
                                     for v in one_each(values.get("prompt_logprobs"), n, "prompt_logprobs")],
                    constraint=constraints, automata=automata)


def one_each(value, n: int, name: str) -> list:
    """One value for every prompt, or a list of one per prompt."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n


def cache_config(cache) -> CacheConfig:
    if cache is None or isinstance(cache, str):
        cache = CacheConfig(kind=cache or "dense")
    if not isinstance(cache, CacheConfig):
        raise TypeError(f"cache must be a CacheConfig, 'dense', 'paged' or None, got {type(cache).__name__}")
    return cache


def spec_config(params: Params, spec) -> SpecConfig | None:
    """The SpecConfig a call runs: the given one checked against the draft (its proposer
    says what suits it), the proposer's default when none is given, None for plain decoding."""
    if spec is not None and not isinstance(spec, SpecConfig):
        raise TypeError(f"spec must be a jspec.SpecConfig or None, got {type(spec).__name__}")
    proposer = proposer_for(params.draft.config if params.draft is not None else None)
    if proposer is None:
        if spec is not None:
            raise ValueError("spec was given but params has no draft; load one with jspec.load(target, draft=...)")
        return None
    spec = proposer.default_spec() if spec is None else spec
    proposer.check_spec(spec)
    if spec.verify_lengths and not proposer.estimates_acceptance():
        raise ValueError(f"SpecConfig.verify_lengths (confidence-budgeted verification) needs a proposer that "
                         f"estimates each draft's chance of acceptance (a block drafter, DFlash); "
                         f"{type(proposer).__name__} does not")
    return spec


def tuning_config(tuning) -> Tuning:
    if tuning is None:
        return DEFAULT_TUNING
    if not isinstance(tuning, Tuning):
        raise TypeError(f"tuning must be a jspec.Tuning or None, got {type(tuning).__name__}")
    return tuning


# ----------------------------------------------------------------------------- packing

def pack(plan: Plan, reqs: Requests, cache: CacheConfig, offsets: dict | None = None) -> tuple[np.ndarray, Admission]:
    """Host arrays admitting `reqs` into rows 0..n-1 of a batch of `plan` -> (rows [B]
    (padding entries: B, no row), Admission [B]); ValueError if they do not fit the plan.
    With `plan.grammar` the Admission brings the constraints' tables, or with `offsets`
    ({automaton key: its first state}, the serving engine's `ConstraintSlots`) the rows'
    start states index the tables the state holds already."""
    n, B = len(reqs.prompts), plan.batch
    lens = reqs.lens
    limits, max_new, room_bound = slot_limits(cache, lens, reqs.max_new, plan.slack)
    num_stop = max(len(s) for s in reqs.stop_ids)
    misfits = [(n > B, f"{n} prompts (it holds {B})"),
               (max(lens) > plan.prompt_len, f"a prompt of {max(lens)} tokens (it holds {plan.prompt_len})"),
               (max(max_new) > plan.max_rounds, f"max_new_tokens={max(max_new)} (it allows {plan.max_rounds})"),
               (max(limits) > plan.layout.capacity, f"{max(limits)} cache slots per request (it has "
                                                    f"{plan.layout.capacity})"),
               (num_stop > plan.num_stop, f"{num_stop} stop ids (it holds {plan.num_stop})"),
               (bool(reqs.grammar) and not plan.grammar, "constraints (it was compiled without any)")]
    for bad, what in misfits:
        if bad:
            raise ValueError(f"these requests do not fit the compiled program: {what}; compile with them instead")

    def col(vals, fill, dtype):
        a = np.full((B,), fill, dtype)
        a[:n] = vals
        return a

    values = dict(reqs.sampling, seed=[fresh_seed() if s is None else s for s in reqs.sampling["seed"]])
    sp = {name: col(values[name], NEUTRAL[name], np.int32 if kind is int else np.float32)
          for name, (kind, _) in SAMPLING_ARGS.items()}
    prompt = np.zeros((B, plan.prompt_len), np.int32)
    stops = np.full((B, plan.num_stop), -1, np.int32)
    for i, (p, s) in enumerate(zip(reqs.prompts, reqs.stop_ids)):
        prompt[i, : len(p)] = p
        stops[i, : len(s)] = s
    grammar, starts = None, [0] * n
    if plan.grammar:
        if offsets is None:
            grammar, offsets = gt.pack([a for a in reqs.automata if a is not None], *plan.grammar,
                                       plan.target.vocab_size)
        starts = [0 if a is None else offsets[a.key] + a.walk(p[len(p) - r:] if r else [])
                  for a, p, r in zip(reqs.automata, reqs.prompts, reqs.resumed)]
    request = RequestRows(prompt_len=col(lens, 1, np.int32), max_new=col(max_new, 1, np.int32),
                          room_bound=col(room_bound, False, bool), slot_limit=col(limits, 0, np.int32),
                          sampling=SamplingParams(**sp), stop_ids=stops, min_tokens=col(reqs.min_tokens, 0, np.int32),
                          speculative=col(reqs.speculative, True, bool), resumed=col(reqs.resumed, 0, np.int32),
                          grammar_start=col(starts, 0, np.int32))
    rows = np.full((B,), B, np.int32)
    rows[:n] = np.arange(n)
    return rows, Admission(prompt=prompt, request=request, grammar=grammar)
