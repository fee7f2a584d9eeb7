"""The public entry points: `logits`, `calibrate_kv_scales`, `compile`, `generate`, `stream`
and `Compiled`.

`compile` checks its input on the host (`jspec.requests`: clear errors before anything
compiles), makes the `Plan` (`jspec.loop.plan.make_plan`: the compile key, with batch,
prompt length and round budget bucketed so similar calls share one program) and compiles
the loop, or finds it compiled already. `Compiled.run` packs requests into the rows of
that plan, moves them to the device explicitly, runs the loop (`jspec.loop.programs`) and
reads the rows back (`jspec.results`). `generate` is `compile` then `run`; `stream` runs
the same rounds in chunks (`jspec.streaming`).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec import requests as rq
from jspec import sharding
from jspec.cache.layout import prefill_meta
from jspec.config import CacheConfig, SpecConfig
from jspec.tuning import Tuning
from jspec.loop import programs
from jspec.loop.plan import make_plan
from jspec.loop.state import MAX_LOGPROBS
from jspec.models import family_for
from jspec.params import Params
from jspec.results import GenerateOutput, SpecStats, generate_output
from jspec.streaming import StreamChunk, chunks

__all__ = ["Compiled", "GenerateOutput", "SpecStats", "calibrate_kv_scales", "clear_caches", "compile", "generate",
           "logits", "stream"]


def logits(params: Params, token_ids) -> jax.Array:
    """Target logits [B,T,V] float32 for token ids (one list, or a batch of lists).

    Rows of unequal length are right-padded; positions past a row's length hold padding.
    """
    arr, lens = padded_ids(params, token_ids, "jspec.logits")
    with mesh_of(params):
        tokens, lens = sharding.replicated(params.mesh, (arr, lens))
        return _logits_jit(params.config, params.weights, tokens, lens)


def calibrate_kv_scales(params: Params, token_ids) -> Params:
    """These params with per-layer FP8 KV-cache scales measured on `token_ids` (one list of
    ids, or a batch of lists), as a checkpoint's `k_scale` / `v_scale` would give them: one
    forward over the prompts into a float cache, and each attention layer's `kv_scale` set
    to the powers of two at or above its keys' and values' largest magnitude over E4M3's
    448 (an MLA layer's: its latent rows'; `quantization.power_of_two_at_least`). They matter
    only with `CacheConfig(dtype="float8_e4m3fn")`, whose cache then holds key / k_scale
    and value / v_scale, so that the model's own range fits E4M3's. Layers whose measured
    magnitude is 0 keep scale 1. A later token can still exceed what the prompts showed
    (it is clipped as at scale 1): calibrate on text like the traffic's."""
    from jspec.cache.layout import CacheLayout, causal_mask, make_meta
    from jspec.quantization import E4M3_MAX, power_of_two_at_least
    arr, lens = padded_ids(params, token_ids, "jspec.calibrate_kv_scales")
    T = arr.shape[1]
    cfg = params.config
    family = family_for(cfg)
    layer_keys = [k for k in sorted(params.weights["params"], key=_layer_number)
                  if k.startswith("layers_") and "self_attn" in params.weights["params"][k]]

    def amax(weights, tokens, lens):
        layout = CacheLayout(paged=False, capacity=T)
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :], tokens.shape)
        valid = pos < lens[:, None]
        meta = make_meta(layout, None, positions=pos, prefix_len=jnp.zeros_like(lens), local_mask=causal_mask(lens, T),
                         write_valid=valid, prefill=True)
        _, _, cache = family.forward(cfg, weights, tokens, family.cache_kind(cfg).init(layout, tokens.shape[0]), meta)
        out = []
        for buf in attention_buffers(cache):  # [B, C + 1, 2, Hkv, Dh] (keys, values) or [B, C + 1, Dc + Dr] (latent rows)
            held = jnp.abs(buf[:, :T].astype(jnp.float32))
            mask = valid.reshape(valid.shape + (1,) * (held.ndim - 2))
            held = jnp.where(mask, held, 0.0)
            out.append(jnp.max(held, axis=(0, 1, 3, 4)) if held.ndim == 5 else jnp.max(held).reshape(1))
        return out
    with mesh_of(params):
        tokens, lens_d = sharding.replicated(params.mesh, (arr, lens))
        found = jax.jit(amax)(params.weights, tokens, lens_d)
    if len(found) != len(layer_keys):
        raise ValueError(f"calibrate_kv_scales: {len(found)} cache buffers for {len(layer_keys)} attention layers; "
                         f"this model's caches are not laid out one per attention layer")
    weights = dict(params.weights)
    weights["params"] = dict(weights["params"])
    for key, a in zip(layer_keys, found):
        a = np.asarray(jax.device_get(a), np.float32)  # [2] keys, values; [1] latent rows
        scales = np.asarray([power_of_two_at_least(x / E4M3_MAX) if x > 0 else 1.0 for x in a], np.float32)
        layer = dict(weights["params"][key])
        layer["self_attn"] = dict(layer["self_attn"], kv_scale=sharding.replicated(params.mesh, scales))
        weights["params"][key] = layer
    return dataclasses.replace(params, weights=weights)


def padded_ids(params: Params, token_ids, caller: str) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (one list, or a batch of lists; checked) -> (ids [B, T] int32 right-padded
    with 0, lengths [B] int32). TypeError: strings instead of ids."""
    rq.check_params(params)
    if isinstance(token_ids, str) or (isinstance(token_ids, (list, tuple)) and
                                      any(isinstance(t, str) for t in token_ids)):
        raise TypeError(f"{caller} takes token ids, not strings")
    batch, _ = rq.prompts(params, token_ids)
    arr = np.zeros((len(batch), max(len(p) for p in batch)), np.int32)
    for i, p in enumerate(batch):
        arr[i, : len(p)] = p
    return arr, np.array([len(p) for p in batch], np.int32)


def attention_buffers(cache) -> tuple:
    """The per-layer buffers attention reads in any cache kind's cache: GQA keys and values
    (`KVCache.kv`, a hybrid's `HybridCache.kv.kv`) or MLA latent rows (`LatentCache.latent`)."""
    if hasattr(cache, "latent"):
        return cache.latent
    return cache.kv.kv if hasattr(cache.kv, "kv") else cache.kv


def _layer_number(key: str) -> int:
    """`layers_<i>` -> i (other keys after them)."""
    return int(key[7:]) if key.startswith("layers_") and key[7:].isdigit() else 1 << 30


def mesh_of(params: Params):
    """The context to trace and run a program in: under the params' mesh, if they are split."""
    return programs.under(params.mesh)


def _logits_fn(cfg, weights, tokens, lens):
    family = family_for(cfg)
    hidden, _, _ = family.forward(cfg, weights, tokens, None, prefill_meta(lens, tokens.shape[1]))
    return family.logits(cfg, weights, hidden)


_logits_jit = jax.jit(_logits_fn, static_argnums=0)

def compiled_programs() -> int:
    """How many compiled programs jspec keeps (one per entry point, plan and shapes)."""
    return programs.compiled_count()


def clear_caches() -> None:
    """Forgets every compiled program, jspec's and jax's traces alike: needed after code
    that tracing reads has changed (a patched function in a benchmark or test)."""
    programs.forget_compiled()
    jax.clear_caches()


class Compiled:
    """The generation loop compiled once for a fixed shape (`jspec.compile`).

    `run` takes new requests (prompts, limits, sampling values, seeds, stop ids) and runs
    them without recompiling, as long as they fit the compiled shape: at most `plan.batch`
    prompts of at most `plan.prompt_len` tokens, max_new_tokens <= `plan.max_rounds`, the
    cache's slots, and at most `plan.num_stop` stop ids a request. A program compiled for
    greedy requests (`plan.sampling` False) compiles the sampling program once, at its
    first run with a temperature or a penalty, and keeps it.
    """

    def __init__(self, params: Params, reqs: rq.Requests, cache: CacheConfig, spec: SpecConfig | None,
                 tuning: Tuning, eager: bool = True):
        self.params, self.cache, self.spec = params, cache, spec
        self._reqs = reqs
        self.compile_s = 0.0
        self.plan = make_plan(params, reqs.lens, reqs.max_new, max(len(s) for s in reqs.stop_ids), reqs.samples,
                              cache, spec, tuning, **logprob_fields(reqs), grammar=reqs.grammar)
        if eager:  # jspec.compile compiles now; jspec.stream compiles its own programs at its first chunk
            self.program(programs.generate_jit, *self.device_inputs(reqs))

    @property
    def executable(self):
        """The compiled generation loop (jax.stages.Compiled) for `plan`."""
        return self.program(programs.generate_jit, *self.device_inputs(self._reqs))

    def program(self, entry, *args, plan=None):
        """A loop entry point (`jspec.loop.programs`) compiled for `plan` (None: this
        call's) and arguments of these shapes (after the weights), once per equal plan,
        weights and shapes."""
        program, seconds = programs.compiled(entry, self.plan if plan is None else plan, self.weights, args,
                                             self.params.mesh)
        self.compile_s += seconds
        return program

    def put(self, tree):
        """Host inputs on the device (on every device of the params' mesh)."""
        return sharding.replicated(self.params.mesh, tree)

    def device_inputs(self, reqs: rq.Requests):
        """(rows, Admission) of these requests for `plan`, on the device."""
        return self.put(rq.pack(self.plan, reqs, self.cache))

    def fit(self, reqs: rq.Requests):
        """Moves a greedy program to its sampling twin when these requests sample, and one
        without logprobs to the plan that keeps them when these requests ask for them."""
        fields = logprob_fields(reqs)
        grammar = reqs.grammar
        roomier = grammar and (not self.plan.grammar or any(a > b for a, b in zip(grammar, self.plan.grammar)))
        if any(v and not getattr(self.plan, k) for k, v in fields.items()) or roomier:
            base = self._reqs
            if roomier:
                grammar = tuple(max(a, b) for a, b in zip(grammar, self.plan.grammar or grammar))
            self.plan = make_plan(self.params, base.lens, base.max_new, max(len(s) for s in base.stop_ids),
                                  self.plan.sampling, self.cache, self.spec, self.plan.tuning,
                                  **{k: v or getattr(self.plan, k) for k, v in fields.items()},
                                  grammar=grammar if roomier else self.plan.grammar)
        if reqs.samples and not self.plan.sampling:
            self.plan = self.plan.variant(sampling=True)

    @property
    def weights(self):
        """(target weights, draft weights or None): the loop's weight arguments."""
        return self.params.weights, self.params.draft.weights if self.params.draft is not None else None

    def requests(self, prompt=None, *, max_new_tokens=None, stop_token_ids=None, **values) -> rq.Requests:
        """Checked requests; arguments left out keep the compiled call's (the prompt
        included). A new prompt takes the defaults of `generate` for what is left out."""
        rq.check_sampling_names(values)
        values = {k: v for k, v in values.items() if v is not None}
        if prompt is None and max_new_tokens is None and stop_token_ids is None and not values:
            return self._reqs
        base = self._reqs if prompt is None else None
        if base is not None:
            values = {**base.values, **values}
        stops = stop_token_ids if stop_token_ids is not None else (base.stop_ids if base else None)
        reqs = rq.check_requests(self.params, self._reqs.prompts if prompt is None else prompt,
                                 max_new_tokens if max_new_tokens is not None else (base.max_new if base else 64),
                                 stops, values)
        if prompt is None:
            reqs = dataclasses.replace(reqs, is_batch=self._reqs.is_batch)
        return reqs

    def inputs(self, prompt=None, **kw):
        """The host-side (rows, Admission) `run` would pass (same arguments as `run`)."""
        return rq.pack(self.plan, self.requests(prompt, **kw), self.cache)

    def run(self, prompt=None, *, max_new_tokens=None, stop_token_ids=None, **values) -> GenerateOutput:
        """Runs requests through the compiled loop (arguments left out: the compiled call's;
        a request without a seed samples with a fresh one at every run)."""
        reqs = self.requests(prompt, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, **values)
        self.fit(reqs)
        rows, adm = self.device_inputs(reqs)
        executable = self.program(programs.generate_jit, rows, adm)
        tw, pw = self.weights
        t0 = time.perf_counter()
        res = jax.device_get(executable(tw, pw, rows, adm))
        run_s = time.perf_counter() - t0
        compile_s, self.compile_s = self.compile_s, 0.0  # reported by the first run only
        return generate_output(self.params, self.plan, res, reqs, compile_s=compile_s, run_s=run_s)

    def stream(self, prompt=None, *, rounds_per_chunk: int = 4, max_new_tokens=None, stop_token_ids=None,
               **values) -> Iterator[StreamChunk]:
        """`run`, streamed: yields a `StreamChunk` every `rounds_per_chunk` rounds (see
        `jspec.stream`)."""
        reqs = self.requests(prompt, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, **values)
        return chunks(self, reqs, rounds_per_chunk)


def logprob_fields(reqs: rq.Requests) -> dict:
    """The `Plan` fields these requests' logprobs need (`make_plan`'s keywords)."""
    wants = reqs.wants_logprobs or reqs.wants_prompt_logprobs
    return dict(logprobs=MAX_LOGPROBS if wants else 0, token_logprobs=reqs.wants_logprobs,
                prompt_logprobs=reqs.wants_prompt_logprobs)


def compile(params: Params, prompt, *, max_new_tokens: int | Sequence[int] = 64,
            stop_token_ids: Sequence | None = None, cache: CacheConfig | str | None = None,
            spec: SpecConfig | None = None, tuning: Tuning | None = None, **sampling) -> Compiled:
    """Compiles the generation loop for these requests' shape (same arguments as
    `generate`) and returns a `Compiled` whose `run(...)` takes requests of that shape.
    Programs are cached: compiling an equal plan again costs nothing."""
    rq.check_params(params)
    reqs = rq.check_requests(params, prompt, max_new_tokens, stop_token_ids, sampling)
    return Compiled(params, reqs, rq.cache_config(cache), rq.spec_config(params, spec), rq.tuning_config(tuning))


def generate(params: Params, prompt, *, max_new_tokens: int | Sequence[int] = 64,
             stop_token_ids: Sequence | None = None, cache: CacheConfig | str | None = None,
             spec: SpecConfig | None = None, tuning: Tuning | None = None, **sampling) -> GenerateOutput:
    """Generates from one prompt or a batch; with a draft in `params`, speculatively.

    prompt: a string, a list of token ids, or a list of either (unequal lengths are fine).
    max_new_tokens: one value or one per prompt. stop_token_ids: None uses the model's EOS
    ids; a list of ids applies to every prompt; a list of lists gives one per prompt.
    cache: a CacheConfig, 'dense' or 'paged'. spec: a SpecConfig (needs a draft); None uses
    the draft's default (a chain). tuning: a `jspec.Tuning` (kernel tiles, XLA options);
    None: the measured defaults.

    Sampling, each one value or one per prompt: temperature
    (0, the default: greedy), top_k (0: off), top_p (1: off), min_p (0: off),
    repetition_penalty (1: off; on prompt and generated tokens), presence_penalty and
    frequency_penalty (0: off; on generated tokens), seed (left out: a fresh random seed
    every run). Speculative output has exactly the distribution of plain sampling with the
    same values (see `jspec.sampling`). A program compiled for greedy requests leaves the
    sampling steps out; one that samples takes any values (greedy rows included) without
    recompiling, and a greedy `Compiled` compiles its sampling twin once, at its first
    sampled run.

    Per request too, each one value or one per prompt: min_tokens (0: off; the stop ids
    cannot be chosen before that many tokens), speculative (False: the request's drafts
    are never accepted, a plain round each time, with the same output), logprobs (k in
    0..20, None: off: each generated token's log-probability under the target, the
    log-softmax of its raw logits, with the k most likely tokens there, in
    `out.logprobs`; from the verification pass, no extra forward) and prompt_logprobs (the
    same for the prompt's tokens, in `out.prompt_logprobs`).
    """
    return compile(params, prompt, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, cache=cache,
                   spec=spec, tuning=tuning, **sampling).run()


def stream(params: Params, prompt, *, rounds_per_chunk: int = 4, max_new_tokens: int | Sequence[int] = 64,
           stop_token_ids: Sequence | None = None, cache: CacheConfig | str | None = None,
           spec: SpecConfig | None = None, tuning: Tuning | None = None, **sampling) -> Iterator[StreamChunk]:
    """`generate`, streamed (same arguments): yields a `StreamChunk` with each request's new
    tokens and text after the prefill and after every `rounds_per_chunk` rounds, the last
    one carrying the `GenerateOutput` that `generate` returns. The chunks concatenate to
    `generate`'s tokens; nothing recompiles between chunks; breaking out of the loop early
    releases the caches.

        for chunk in jspec.stream(params, "def fib(n):", max_new_tokens=64):
            print(chunk.text, end="", flush=True)
    """
    rq.check_params(params)
    reqs = rq.check_requests(params, prompt, max_new_tokens, stop_token_ids, sampling)
    prog = Compiled(params, reqs, rq.cache_config(cache), rq.spec_config(params, spec), rq.tuning_config(tuning),
                    eager=False)
    return chunks(prog, reqs, rounds_per_chunk)
