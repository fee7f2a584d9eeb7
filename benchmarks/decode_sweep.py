"""Decode-step variants side by side in one process (H200): the batch-1 Llama-3.1-8B step
(random bf16 weights, context 1k) timed for each variant of the attention kernel's
launch parameters, or of the loop (PATCHES), with per-kernel times from a profiler trace.

Run: PYTHONPATH=. python3 benchmarks/decode_sweep.py [batch] [variant ...] [S,K,N]   (default:
all variants; S,K,N: rounds of speculative decoding with a random EAGLE-3-shaped head instead
of plain decoding steps; JSPEC_BENCH_TAG names the output file, XLA_FLAGS may vary per run)
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
from unittest import mock

import jax

import jspec

from benchmarks.bench_8b import prompts
from benchmarks.common import Runner, bench_tag, env_info, model_for, save_json
from benchmarks.profile_decode import busy_and_gaps, kernel_spans
from jspec import sampling
from jspec.cache.layout import CacheLayout, make_meta
from jspec.kernels import decode_attention as da
from jspec.kernels import dispatch
from jspec.loop import loop

# name -> keyword overrides for paged_decode_attention ("reference": XLA attention)
VARIANTS = {
    "default": {},
    "reference": None,
    "bk64_s10": {"block_k": 64, "num_splits": 10},  # the defaults before 2026-11-22
    "bk32_s20": {"block_k": 32, "num_splits": 20},
    "bk64_s20": {"block_k": 64, "num_splits": 20},
    "bk128_s8": {"block_k": 128, "num_splits": 8},
    "bk128_w2": {"block_k": 128, "num_warps": 2},
    "bk256_s5": {"block_k": 256, "num_splits": 5},
    "default_again": {},
    "s1": {"num_splits": 1},  # one program per (row, kv head): nothing to merge
    "s1_bk64": {"block_k": 64, "num_splits": 1},
    "s1_bk256": {"block_k": 256, "num_splits": 1},
    "s1_st3": {"num_splits": 1, "num_stages": 3},
    "s2": {"num_splits": 2},
}


def _argmax_only(logits, *_):
    return jax.numpy.argmax(logits, axis=-1).astype(jax.numpy.int32)


def _run_unrolled(plan, tw, dw, inp):
    """loop.run with two rounds per while-loop iteration: half the loop-condition syncs
    (a round for finished rows only masks; at most one round runs in vain at the end)."""
    st = loop.prefill(plan, tw, dw, inp, loop.init_state(plan, inp))
    one = functools.partial(loop.round_step, plan, tw, dw, inp)
    return jax.lax.while_loop(lambda s: jax.numpy.any(~s.finished) & (s.step < plan.max_rounds),
                              lambda s: one(one(s)), st)


def _meta_without_room(layout, pages, **kw):
    """CacheLayout.meta without q_room: no forward parks its queries in the cache."""
    return make_meta(layout, pages, **kw)


# name -> a context manager changing the loop (measures what a part of the step costs)
PATCHES = {
    "greedy_only": lambda: mock.patch.object(sampling, "sample", _argmax_only),  # no sampling branch
    "no_parking": lambda: mock.patch.object(CacheLayout, "meta", _meta_without_room),  # q not in the cache
    "unroll2": lambda: mock.patch.object(loop, "run", _run_unrolled),
}


def main(batch: int = 1, names=None, shape: str = ""):
    tag = bench_tag(shape)
    res = {"env": env_info(), "batch": batch, "shape": shape, "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "rows": {}}
    print(res["env"], flush=True)
    target, spec = model_for(shape)
    orig = da.paged_decode_attention
    variants = {**VARIANTS, **{k: {} for k in PATCHES}}
    for name, kw in variants.items():
        if names and name not in names:
            continue
        jspec.clear_caches()
        da.paged_decode_attention = functools.partial(orig, **(kw or {}))
        try:
            with dispatch.use_backend("reference" if kw is None else "auto"), \
                    PATCHES.get(name, contextlib.nullcontext)():
                r = Runner(target, prompts(batch), 144, spec=spec)
            per, _, _ = r.per_round(16, 144)
            r.run(40)
            d = tempfile.mkdtemp()
            jax.profiler.start_trace(d)
            _, out = r.run(40)
            jax.profiler.stop_trace()
        except Exception as e:  # noqa: BLE001
            print(name, "failed:", repr(e)[:300], flush=True)
            continue
        finally:
            da.paged_decode_attention = orig
        stats, spans = kernel_spans(d)
        steps = max(out.stats.rounds)
        gaps = sorted(busy_and_gaps(spans)[1], reverse=True)[2:]  # the two around the prefill left out
        idle = sum(g for g in gaps if g > 2.0) / steps
        per_step = {n: (c / steps, t / steps) for n, (c, t) in stats.items()}
        attn = sum(t for n, (c, t) in per_step.items() if "attention" in n)
        kernels = sum(c for c, t in per_step.values())
        tokens = out.tokens
        first = res.setdefault("tokens", tokens)
        res["rows"][name] = {"kw": kw, "ms_per_step": per * 1e3, "attention_us": attn, "kernels_per_step": kernels,
                             "idle_us_per_step": idle,
                             "same_tokens_as_first_variant": tokens == first,
                             "kernels": sorted(per_step.items(), key=lambda x: -x[1][1])[:40]}
        print(f"{name:14s} {per * 1e3:7.3f} ms/round  attention kernel {attn:6.1f} us/round  {kernels:5.0f} kernels/round"
              f"  idle {idle:5.1f} us/round  same tokens: {tokens == first}", flush=True)
        save_json(f"decode_sweep_b{batch}{'_' + tag if tag else ''}.json", res)
        del r
    print("\n".join(f"{k:14s} {v['ms_per_step']:7.3f} {v['attention_us']:6.1f}" for k, v in res["rows"].items()))


if __name__ == "__main__":
    args = sys.argv[2:]
    shapes = [a for a in args if "," in a]
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1, set(a for a in args if "," not in a) or None,
         shapes[0] if shapes else "")
