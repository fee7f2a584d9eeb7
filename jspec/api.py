"""The public entry points: `logits`, `compile` and `generate`.

`compile` checks its input on the host (clear errors before anything compiles), builds the
`Plan` (the compile key: batch, prompt length and round budget bucketed so similar calls
share one program) and compiles the one jitted loop, or finds it compiled already.
`Compiled.run` turns requests into `LoopInputs` for that plan, moves them to the device
explicitly, runs the loop and fetches the result. `generate` is `compile` then `run`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import os
import time
from typing import Any, Iterator, Sequence

import jax
import numpy as np

from jspec import sharding
from jspec.cache.layout import CacheLayout, prefill_meta
from jspec.config import CacheConfig, SpecConfig
from jspec.kernels import dispatch
from jspec.models import family_for
from jspec.params import Params
from jspec.sampling import SamplingParams, any_processing
from jspec.loop import loop
from jspec.loop.plan import LoopInputs, Plan, round_slack
from jspec.streaming import StreamChunk
from jspec.streaming import chunks as stream_chunks
from jspec.util import cdiv, round_up

DEFAULT_SPEC = SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)


@dataclasses.dataclass
class SpecStats:
    """Acceptance statistics. accept_lengths[i]: tokens committed per verify round of
    request i (accepted drafts + the bonus token; always 1 without a draft)."""

    accept_lengths: list[list[int]]
    mean_accept_length: float  # tau over every round of every request
    histogram: dict[int, int]  # accept length -> rounds
    rounds: list[int]
    tokens_per_s: float

    @property
    def tau(self) -> float:
        return self.mean_accept_length


@dataclasses.dataclass
class GenerateOutput:
    """tokens: generated ids only (a list for one prompt, a list of lists for a batch; an
    emitted stop token is included). finish_reasons: 'stop', 'length' or 'cache_full'."""

    tokens: Any
    text: Any
    finish_reasons: Any
    stats: SpecStats
    timing: dict


# ----------------------------------------------------------------------------- checks

def _is_int(x) -> bool:
    return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_params(params):
    if not isinstance(params, Params):
        raise TypeError(f"params must be what jspec.load returns (jspec.Params), got {type(params).__name__}")


def _token_list(seq, vocab: int, what: str) -> list[int]:
    if isinstance(seq, np.ndarray):
        if seq.ndim != 1 or not np.issubdtype(seq.dtype, np.integer):
            raise TypeError(f"{what} must be a 1-D integer array, got {seq.dtype} with shape {seq.shape}")
        seq = seq.tolist()
    if not isinstance(seq, (list, tuple)):
        raise TypeError(f"{what} must be a string or a list of token ids, got {type(seq).__name__}")
    if len(seq) == 0:
        raise ValueError(f"{what} is empty")
    for t in seq:
        if not _is_int(t):
            raise TypeError(f"{what} holds {t!r} ({type(t).__name__}); token ids must be ints")
        if not 0 <= t < vocab:
            raise ValueError(f"{what} holds token id {t}, outside the vocabulary [0, {vocab})")
    return [int(t) for t in seq]


def _prompts(params: Params, prompt) -> tuple[list[list[int]], bool]:
    """-> (token lists, was it a batch)."""
    V = params.config.vocab_size

    def encode(s: str, what: str) -> list[int]:
        if params.tokenizer is None:
            raise ValueError("a string prompt needs a tokenizer, and this model directory has none; "
                             "pass token ids instead")
        if not s:
            raise ValueError(f"{what} is an empty string")
        return _token_list(list(params.tokenizer(s)["input_ids"]), V, what)

    if isinstance(prompt, str):
        return [encode(prompt, "prompt")], False
    if isinstance(prompt, np.ndarray) and prompt.ndim == 2:
        prompt = list(prompt)
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, (str, list, tuple, np.ndarray))
                                                            for p in prompt):
        out = []
        for i, p in enumerate(prompt):
            what = f"prompt[{i}]"
            out.append(encode(p, what) if isinstance(p, str) else _token_list(p, V, what))
        return out, True
    if isinstance(prompt, (list, tuple, np.ndarray)):
        return [_token_list(prompt, V, "prompt")], False
    raise TypeError(f"prompt must be a string, a list of token ids, or a list of either; got {type(prompt).__name__}")


def _per_request(value, n: int, name: str, kind, check) -> list:
    vals = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value] * n
    if len(vals) != n:
        raise ValueError(f"{name} has {len(vals)} entries for {n} prompts")
    out = []
    for v in vals:
        if kind is int and not _is_int(v):
            raise TypeError(f"{name} must be an int (or one per prompt), got {v!r}")
        if kind is float and (isinstance(v, bool) or not isinstance(v, (numbers.Real, np.floating, np.integer))):
            raise TypeError(f"{name} must be a number (or one per prompt), got {v!r}")
        v = kind(v)
        msg = check(v)
        if msg:
            raise ValueError(f"{name} {msg}, got {v!r}")
        out.append(v)
    return out


def _stop_ids(params: Params, stop_token_ids) -> list[int]:
    V = params.config.vocab_size
    if stop_token_ids is None:
        ids = set(params.config.eos_token_ids)
        tok = params.tokenizer
        if tok is not None and getattr(tok, "eos_token_id", None) is not None:
            ids.add(int(tok.eos_token_id))
        return sorted(i for i in ids if 0 <= i < V)
    if _is_int(stop_token_ids):
        stop_token_ids = [stop_token_ids]
    if not isinstance(stop_token_ids, (list, tuple, set)):
        raise TypeError(f"stop_token_ids must be a list of ints or None, got {type(stop_token_ids).__name__}")
    out = []
    for t in stop_token_ids:
        if not _is_int(t):
            raise TypeError(f"stop_token_ids holds {t!r}; token ids must be ints")
        if not 0 <= t < V:
            raise ValueError(f"stop token id {t} is outside the vocabulary [0, {V})")
        out.append(int(t))
    return sorted(set(out))


def _pow2(n: int, lo: int = 1) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def _prompt_bucket(n: int) -> int:
    return _pow2(n, 16) if n <= 512 else round_up(n, 256)


# ----------------------------------------------------------------------------- API

def logits(params: Params, token_ids) -> jax.Array:
    """Target logits [B,T,V] float32 for token ids (one list, or a batch of lists).

    Rows of unequal length are right-padded; positions past a row's length hold padding.
    """
    _check_params(params)
    if isinstance(token_ids, str) or (isinstance(token_ids, (list, tuple)) and
                                      any(isinstance(t, str) for t in token_ids)):
        raise TypeError("jspec.logits takes token ids, not strings")
    batch, _ = _prompts(params, token_ids)
    T = max(len(p) for p in batch)
    arr = np.zeros((len(batch), T), np.int32)
    for i, p in enumerate(batch):
        arr[i, : len(p)] = p
    lens = np.array([len(p) for p in batch], np.int32)
    with _mesh(params):
        tokens, lens = sharding.replicated(params.mesh, (arr, lens))
        return _logits_jit(params.config, params.weights, tokens, lens)


def _mesh(params: Params):
    """The context to trace and run a program in: under the params' mesh, if they are split."""
    return contextlib.nullcontext() if params.mesh is None else jax.set_mesh(params.mesh)


def _logits_fn(cfg, weights, tokens, lens):
    family = family_for(cfg)
    hidden, _, _ = family.forward(cfg, weights, tokens, None, prefill_meta(lens, tokens.shape[1]))
    return family.logits(cfg, weights, hidden)


_logits_jit = jax.jit(_logits_fn, static_argnums=0)


@dataclasses.dataclass(frozen=True)
class _Requests:
    """Checked requests, one entry per prompt (host values)."""

    prompts: list
    is_batch: bool
    max_new: list
    sampling: dict  # SamplingParams field -> one value per prompt
    stop_ids: list

    @property
    def samples(self) -> bool:
        """Does some request sample or carry a penalty (`Plan.sampling`)?"""
        return any_processing(SamplingParams(**{k: np.asarray(v) for k, v in self.sampling.items()}))


# The sampling arguments: (neutral value, type, check -> message or None). `generate`,
# `compile` and `Compiled.run` take each one value or one per prompt.
SAMPLING_ARGS = {
    "temperature": (0.0, float, lambda v: None if math.isfinite(v) and v >= 0 else "must be finite and >= 0"),
    "top_k": (0, int, lambda v: None if v >= 0 else "must be >= 0"),
    "top_p": (1.0, float, lambda v: None if 0 < v <= 1 else "must be in (0, 1]"),
    "min_p": (0.0, float, lambda v: None if 0 <= v <= 1 else "must be in [0, 1]"),
    "repetition_penalty": (1.0, float, lambda v: None if math.isfinite(v) and v > 0 else "must be finite and > 0"),
    "presence_penalty": (0.0, float, lambda v: None if math.isfinite(v) else "must be finite"),
    "frequency_penalty": (0.0, float, lambda v: None if math.isfinite(v) else "must be finite"),
    "seed": (0, int, lambda v: None if 0 <= v < 2 ** 31 else "must be in [0, 2**31)"),
}


def _check_sampling_names(sampling: dict) -> None:
    unknown = sorted(set(sampling) - set(SAMPLING_ARGS))
    if unknown:
        raise TypeError(f"unexpected argument {unknown[0]!r}; the sampling arguments are {', '.join(SAMPLING_ARGS)}")


def _requests(params: Params, prompt, max_new_tokens, stop_token_ids, sampling: dict) -> _Requests:
    """sampling: {name in SAMPLING_ARGS: value or one per prompt}; missing names are neutral."""
    _check_sampling_names(sampling)
    prompts, is_batch = _prompts(params, prompt)
    n = len(prompts)
    values = {}
    for name, (neutral, kind, check) in SAMPLING_ARGS.items():
        v = sampling.get(name)
        values[name] = _per_request(neutral if v is None else v, n, name, kind, check)
    return _Requests(
        prompts=prompts, is_batch=is_batch,
        max_new=_per_request(max_new_tokens, n, "max_new_tokens", int, lambda v: "must be >= 1" if v < 1 else None),
        sampling=values, stop_ids=_stop_ids(params, stop_token_ids))


def _cache_config(cache) -> CacheConfig:
    if cache is None or isinstance(cache, str):
        cache = CacheConfig(kind=cache or "dense")
    if not isinstance(cache, CacheConfig):
        raise TypeError(f"cache must be a CacheConfig, 'dense', 'paged' or None, got {type(cache).__name__}")
    return cache


def _spec_config(params: Params, spec) -> SpecConfig | None:
    if spec is not None and not isinstance(spec, SpecConfig):
        raise TypeError(f"spec must be a jspec.SpecConfig or None, got {type(spec).__name__}")
    if spec is not None and params.draft is None:
        raise ValueError("spec was given but params has no draft; load one with jspec.load(target, draft=...)")
    if params.draft is not None and spec is None:
        spec = DEFAULT_SPEC
    if spec is not None and spec.topk > params.draft.config.vocab_size:  # top-k of Vd draft logits
        Vd = params.draft.config.vocab_size
        raise ValueError(f"SpecConfig.topk={spec.topk} exceeds the draft's vocabulary of {Vd} tokens; "
                         f"topk must be at most {Vd}")
    return spec


def _slot_limits(cache: CacheConfig, reqs: _Requests, slack: int):
    """-> (slots each request may use, max_new cut to the cache's room, was it cut)."""
    lens = [len(p) for p in reqs.prompts]
    if cache.max_len is None:
        return [l + m + slack for l, m in zip(lens, reqs.max_new)], list(reqs.max_new), [False] * len(lens)
    too_long = [i for i, l in enumerate(lens) if l >= cache.max_len]
    if too_long:
        i = too_long[0]
        raise ValueError(f"prompt {i} has {lens[i]} tokens, which does not fit a cache of max_len="
                         f"{cache.max_len} (it needs room for at least one generated token)")
    room = [cache.max_len - l for l in lens]  # a request holds at most max_len tokens
    return ([cache.max_len + slack] * len(lens), [min(r, m) for r, m in zip(room, reqs.max_new)],
            [r < m for r, m in zip(room, reqs.max_new)])


def _plan(params: Params, reqs: _Requests, cache: CacheConfig, spec: SpecConfig | None) -> Plan:
    """The one place a Plan is built: buckets for batch, prompt length, rounds and stop ids."""
    draft = params.draft.config if params.draft is not None else None
    paged = cache.kind == "paged"
    slack = round_slack(params.config, draft, spec, paged)
    limits, max_new, _ = _slot_limits(cache, reqs, slack)
    B = _pow2(len(reqs.prompts))
    lens = [len(p) for p in reqs.prompts]
    Tp = _prompt_bucket(max(lens))
    P = cache.page_size
    if paged:
        capacity = round_up(max(max(limits), Tp), P)
        num_pages = cache.num_pages if cache.num_pages is not None else capacity // P * B
        for i, l in enumerate(lens):
            if cdiv(l + slack, P) > num_pages:
                raise ValueError(f"prompt {i} needs {cdiv(l + slack, P)} pages of {P} tokens but the pool "
                                 f"has num_pages={num_pages}")
        layout = CacheLayout(paged=True, capacity=capacity, page_size=P, num_pages=num_pages)
    else:
        layout = CacheLayout(paged=False, capacity=round_up(max(max(limits), Tp), 64))
    plan = Plan(target=params.config, draft=draft, spec=spec, layout=layout, batch=B, prompt_len=Tp,
                max_rounds=_pow2(max(max_new), 8), num_stop=_pow2(len(reqs.stop_ids), 4), sampling=reqs.samples)
    _check_memory(params, plan, max(reqs.max_new))
    return plan


def _nbytes(tree) -> int:
    """Bytes of a pytree of arrays (or of shape-dtype structs)."""
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def _shard_bytes(a) -> int:
    """Bytes of an array on one device: its first shard's (all of it when not split)."""
    shards = getattr(a, "addressable_shards", None)
    return shards[0].data.nbytes if shards else _nbytes(a)


def _plan_bytes(plan: Plan) -> int:
    """Bytes of the loop's buffers that grow with the plan: the target's and the draft's
    caches (as their cache kinds allocate them, dense or paged), the token buffer and the
    accept-length history. Activations are left out: this is a lower bound."""
    B = plan.batch
    kinds = [plan.family.cache_kind(plan.target)] + ([plan.draft.cache_kind()] if plan.draft else [])
    caches = jax.eval_shape(lambda: [k.init(plan.layout, B) for k in kinds])  # shapes only, nothing allocated
    hist = plan.max_rounds if plan.draft else 0
    return _nbytes(caches) + 4 * B * (plan.buffer_len + hist)  # tokens [B, buffer_len], hist [B, R] int32


def _device_memory() -> tuple[int, str] | None:
    """(bytes, what) generation may fill: the default device's `bytes_limit` where jax
    reports one (GPUs), else the machine's physical memory (CPU); None if neither is known."""
    dev = jax.devices()[0]
    try:
        limit = (dev.memory_stats() or {}).get("bytes_limit")
    except Exception:  # backends without memory statistics
        limit = None
    if limit:
        return int(limit), f"{dev.platform.upper()} device {dev.id}"
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's physical memory"
    except (AttributeError, OSError, ValueError):
        return None


def _check_memory(params: Params, plan: Plan, max_new: int) -> None:
    """Refuses a plan whose caches and token buffers, with the weights, exceed the device's
    memory: a clear error now instead of an out-of-memory error from XLA after compiling."""
    have = _device_memory()
    if have is None:
        return
    limit, where = have
    n = 1 if params.mesh is None else params.mesh.size  # the caches are split by KV head
    need = _plan_bytes(plan) // n
    weights = sum(_shard_bytes(a) for a in jax.tree.leaves((params.weights, params.draft.weights
                                                             if params.draft is not None else None)))
    if need + weights > limit:
        gib = lambda b: f"{b / 2 ** 30:,.1f} GiB"
        lay = plan.layout
        what = (f"a pool of {lay.num_pages} pages of {lay.page_size} tokens" if lay.paged else
                f"{plan.batch} request slots of {lay.capacity} tokens")
        raise ValueError(f"max_new_tokens={max_new} does not fit in memory: the caches and token buffers ({what}) "
                         f"need about {gib(need)} plus {gib(weights)} of weights, but {where} has {gib(limit)}; "
                         f"ask for a smaller max_new_tokens, or cap each request with CacheConfig(max_len=...)"
                         + (" or the pool with a smaller num_pages" if lay.paged else ""))


def _inputs(plan: Plan, reqs: _Requests, cache: CacheConfig) -> LoopInputs:
    """Host-side LoopInputs of these requests for `plan`; ValueError if they do not fit it."""
    n, B = len(reqs.prompts), plan.batch
    lens = [len(p) for p in reqs.prompts]
    limits, max_new, room_bound = _slot_limits(cache, reqs, plan.slack)
    misfits = [(n > B, f"{n} prompts (it holds {B})"),
               (max(lens) > plan.prompt_len, f"a prompt of {max(lens)} tokens (it holds {plan.prompt_len})"),
               (max(max_new) > plan.max_rounds, f"max_new_tokens={max(max_new)} (it allows {plan.max_rounds})"),
               (max(limits) > plan.layout.capacity, f"{max(limits)} cache slots per request (it has "
                                                    f"{plan.layout.capacity})"),
               (len(reqs.stop_ids) > plan.num_stop, f"{len(reqs.stop_ids)} stop ids (it holds {plan.num_stop})")]
    for bad, what in misfits:
        if bad:
            raise ValueError(f"these requests do not fit the compiled program: {what}; compile with them instead")

    def col(vals, fill, dtype):
        a = np.full((B,), fill, dtype)
        a[:n] = vals
        return a

    sp = {name: col(reqs.sampling[name], neutral, np.int32 if kind is int else np.float32)
          for name, (neutral, kind, _) in SAMPLING_ARGS.items()}

    prompt_arr = np.zeros((B, plan.prompt_len), np.int32)
    for i, p in enumerate(reqs.prompts):
        prompt_arr[i, : len(p)] = p
    stop_arr = np.full((plan.num_stop,), -1, np.int32)
    stop_arr[: len(reqs.stop_ids)] = reqs.stop_ids
    return LoopInputs(prompt=prompt_arr, prompt_len=col(lens, 1, np.int32), max_new=col(max_new, 1, np.int32),
                      room_bound=col(room_bound, False, bool), slot_limit=col(limits, 0, np.int32),
                      real=col([True] * n, False, bool), sampling=SamplingParams(**sp), stop_ids=stop_arr)


_COMPILED: dict = {}  # (plan, weight shapes, kernel backend) -> compiled loop


def clear_caches() -> None:
    """Forgets every compiled program, jspec's and jax's traces alike: needed after code
    that tracing reads has changed (a patched function in a benchmark or test)."""
    _COMPILED.clear()
    jax.clear_caches()


class Compiled:
    """The generation loop compiled once for a fixed shape (`jspec.compile`).

    `run` takes new requests (prompts, limits, sampling values, seeds, stop ids) and runs
    them without recompiling, as long as they fit the compiled shape: at most `plan.batch`
    prompts of at most `plan.prompt_len` tokens, max_new_tokens <= `plan.max_rounds`, the
    cache's slots, and at most `plan.num_stop` stop ids. A program compiled for greedy
    requests (`plan.sampling` False) compiles the sampling program once, at its first run
    with a temperature or a penalty, and keeps it.
    """

    def __init__(self, params: Params, reqs: _Requests, cache: CacheConfig, spec: SpecConfig | None,
                 eager: bool = True):
        self.params, self.cache, self.spec = params, cache, spec
        self._reqs = reqs
        self.compile_s = 0.0
        self.plan = _plan(params, reqs, cache, spec)
        self.xla_options = dispatch.compiler_options(family_for(params.config).gpu_xla_options(params.config))
        if eager:  # jspec.compile compiles now; jspec.stream compiles its own programs at its first chunk
            self.program(loop.generate_jit, reqs)

    @property
    def executable(self):
        """The compiled generation loop (jax.stages.Compiled) for `plan`."""
        return self.program(loop.generate_jit, self._reqs)

    def program(self, entry, reqs: _Requests, *args):
        """A loop entry point (`loop.generate_jit`, `start_jit`, `advance_jit`) compiled for
        `plan`, once per equal plan and weight shapes; args: its arguments after the inputs."""
        tw, dw = self.weights
        options = self.xla_options
        key = (entry, self.plan, jax.tree.structure((tw, dw)),
               tuple((a.shape, a.dtype) for a in jax.tree.leaves((tw, dw))), dispatch.backend(), self.params.mesh,
               tuple(sorted(options.items())))
        if key not in _COMPILED:
            t0 = time.perf_counter()
            with _mesh(self.params):
                inp = self.put(_inputs(self.plan, reqs, self.cache))
                _COMPILED[key] = entry.lower(self.plan, tw, dw, inp, *args).compile(options or None)
            self.compile_s += time.perf_counter() - t0
        return _COMPILED[key]

    def put(self, tree):
        """Host inputs on the device (on every device of the params' mesh)."""
        return sharding.replicated(self.params.mesh, tree)

    def fit(self, reqs: _Requests):
        """Moves a greedy program to its sampling twin when these requests sample."""
        if reqs.samples and not self.plan.sampling:
            self.plan = dataclasses.replace(self.plan, sampling=True)

    @property
    def weights(self):
        """(target weights, draft weights or None): the loop's weight arguments."""
        return self.params.weights, self.params.draft.weights if self.params.draft is not None else None

    def requests(self, prompt=None, *, max_new_tokens=None, stop_token_ids=None, **sampling) -> _Requests:
        """Checked requests; arguments left out keep the compiled call's (the prompt
        included). A new prompt takes the defaults of `generate` for what is left out."""
        _check_sampling_names(sampling)
        sampling = {k: v for k, v in sampling.items() if v is not None}
        if prompt is None and max_new_tokens is None and stop_token_ids is None and not sampling:
            return self._reqs
        base = self._reqs if prompt is None else None
        if base is not None:
            sampling = {**base.sampling, **sampling}
        reqs = _requests(self.params, self._reqs.prompts if prompt is None else prompt,
                         max_new_tokens if max_new_tokens is not None else (base.max_new if base else 64),
                         stop_token_ids if stop_token_ids is not None else (base.stop_ids if base else None), sampling)
        if prompt is None:
            reqs = dataclasses.replace(reqs, is_batch=self._reqs.is_batch)
        return reqs

    def inputs(self, prompt=None, **kw) -> LoopInputs:
        """The host-side LoopInputs `run` would pass (same arguments as `run`)."""
        return _inputs(self.plan, self.requests(prompt, **kw), self.cache)

    def run(self, prompt=None, *, max_new_tokens=None, stop_token_ids=None, **sampling) -> GenerateOutput:
        """Runs requests through the compiled loop (arguments left out: the compiled call's)."""
        reqs = self.requests(prompt, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, **sampling)
        self.fit(reqs)
        executable = self.program(loop.generate_jit, reqs)
        inp = self.put(_inputs(self.plan, reqs, self.cache))
        tw, dw = self.weights
        t0 = time.perf_counter()
        res = jax.device_get(executable(tw, dw, inp))
        run_s = time.perf_counter() - t0
        compile_s, self.compile_s = self.compile_s, 0.0  # reported by the first run only
        return _outputs(self.params, self.plan, res, [len(p) for p in reqs.prompts], reqs.is_batch,
                        compile_s=compile_s, run_s=run_s)

    def stream(self, prompt=None, *, rounds_per_chunk: int = 4, max_new_tokens=None, stop_token_ids=None,
               **sampling) -> Iterator[StreamChunk]:
        """`run`, streamed: yields a `StreamChunk` every `rounds_per_chunk` rounds (see
        `jspec.stream`)."""
        reqs = self.requests(prompt, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, **sampling)
        return stream_chunks(self, reqs, rounds_per_chunk)


def compile(params: Params, prompt, *, max_new_tokens: int | Sequence[int] = 64,
            stop_token_ids: Sequence[int] | None = None, cache: CacheConfig | str | None = None,
            spec: SpecConfig | None = None, **sampling) -> Compiled:
    """Compiles the generation loop for these requests' shape (same arguments as
    `generate`) and returns a `Compiled` whose `run(...)` takes requests of that shape.
    Programs are cached: compiling an equal plan again costs nothing."""
    _check_params(params)
    reqs = _requests(params, prompt, max_new_tokens, stop_token_ids, sampling)
    cache = _cache_config(cache)
    spec = _spec_config(params, spec)
    return Compiled(params, reqs, cache, spec)


def generate(params: Params, prompt, *, max_new_tokens: int | Sequence[int] = 64,
             stop_token_ids: Sequence[int] | None = None, cache: CacheConfig | str | None = None,
             spec: SpecConfig | None = None, **sampling) -> GenerateOutput:
    """Generates from one prompt or a batch; with a draft in `params`, speculatively.

    prompt: a string, a list of token ids, or a list of either (unequal lengths are fine).
    max_new_tokens: one value or one per prompt. stop_token_ids: None uses the model's EOS
    ids. cache: a CacheConfig, 'dense' or 'paged'. spec: a SpecConfig (needs a draft); None
    uses a default chain when there is a draft.

    Sampling, each one value or one per prompt: temperature
    (0, the default: greedy), top_k (0: off), top_p (1: off), min_p (0: off),
    repetition_penalty (1: off; on prompt and generated tokens), presence_penalty and
    frequency_penalty (0: off; on generated tokens), seed. Speculative output has exactly
    the distribution of plain sampling with the same values (see `jspec.sampling`). A
    program compiled for greedy requests leaves the sampling steps out; one that samples
    takes any values (greedy rows included) without recompiling, and a greedy `Compiled`
    compiles its sampling twin once, at its first sampled run.
    """
    return compile(params, prompt, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, cache=cache,
                   spec=spec, **sampling).run()


def stream(params: Params, prompt, *, rounds_per_chunk: int = 4, max_new_tokens: int | Sequence[int] = 64,
           stop_token_ids: Sequence[int] | None = None, cache: CacheConfig | str | None = None,
           spec: SpecConfig | None = None, **sampling) -> Iterator[StreamChunk]:
    """`generate`, streamed (same arguments): yields a `StreamChunk` with each request's new
    tokens and text after the prefill and after every `rounds_per_chunk` rounds, the last
    one carrying the `GenerateOutput` that `generate` returns. The chunks concatenate to
    `generate`'s tokens; nothing recompiles between chunks; breaking out of the loop early
    releases the caches.

        for chunk in jspec.stream(params, "def fib(n):", max_new_tokens=64):
            print(chunk.text, end="", flush=True)
    """
    _check_params(params)
    reqs = _requests(params, prompt, max_new_tokens, stop_token_ids, sampling)
    prog = Compiled(params, reqs, _cache_config(cache), _spec_config(params, spec), eager=False)
    return stream_chunks(prog, reqs, rounds_per_chunk)


def _outputs(params, plan, res, lens, is_batch, *, compile_s, run_s) -> GenerateOutput:
    tokens, reasons, accept = [], [], []
    for i, l in enumerate(lens):
        g = int(res["generated"][i])
        tokens.append([int(t) for t in res["tokens"][i, l: l + g]])
        reasons.append(loop.FINISH_REASONS[int(res["reason"][i])])
        rounds = int(res["rounds"][i])
        accept.append([int(a) for a in res["hist"][i, :rounds]] if plan.draft is not None else [1] * rounds)
    total = sum(len(t) for t in tokens)
    all_rounds = [a for row in accept for a in row]
    hist: dict[int, int] = {}
    for a in all_rounds:
        hist[a] = hist.get(a, 0) + 1
    tps = total / run_s if run_s > 0 else float("nan")
    stats = SpecStats(accept_lengths=accept,
                      mean_accept_length=float(np.mean(all_rounds)) if all_rounds else float("nan"),
                      histogram=dict(sorted(hist.items())), rounds=[len(a) for a in accept], tokens_per_s=tps)
    tok = params.tokenizer
    texts = [tok.decode(t, skip_special_tokens=True) for t in tokens] if tok is not None else None
    timing = dict(compile_s=compile_s, run_s=run_s, new_tokens=total, tokens_per_s=tps)
    if not is_batch:
        return GenerateOutput(tokens[0], texts[0] if texts else None, reasons[0], stats, timing)
    return GenerateOutput(tokens, texts, reasons, stats, timing)
