"""Qwen3.5-27B (dense) and Qwen3.5-35B-A3B (MoE) shapes with random bf16 weights (one GPU).

check: float32 greedy through the kernels on a small random model: MTP chains and trees
and an n-gram chain against plain decoding, kernels against references (`gpu_check`).

decode: ms/token at batch 1 and 32 (context 1k) and bandwidth utilisation = bytes a step
must move / step time / copy bandwidth; the bytes: weights used (all but the embedding
table; MoE: the fixed weights and the expected distinct experts of the step's tokens), the
full-attention layers' KV, and every linear layer's conv and delta-rule states read and
written. mtp: MTP chain S = 1..3 (mtp3: S = 3 only) and tree (3,2,4) rounds as ratios to one AR step
(a random MTP layer: its acceptance is not the point; the round's cost is). commit: the
commit alone (a replay record, or per-node checkpoints) on the shape's state at batch 1
and 32 with the chain S=3 record (N = 4): its time, its share of that round, and the
record's memory; and the S=3 round under `Tuning(recurrent_commit="checkpoint")`.

Run: PYTHONPATH=. python3 benchmarks/qwen35.py check | 27b|35b [decode] [mtp | mtp3] [commit] [--batches 1,32]
"""
from __future__ import annotations

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from benchmarks.common import (CTX, QWEN35_27B, QWEN35_35B_A3B, Runner, ceiling_of, copy_bandwidth, env_info,
                               median_time, prompts, random_params, rounded, save_json)
from jspec.cache.layout import CacheLayout
from jspec.drafts.qwen_mtp import QwenMtpDraft, layer_config
from jspec.models import family_for

SHORT, LONG = 16, 80
SHAPES = {"27b": QWEN35_27B, "35b": QWEN35_35B_A3B}


def distinct_experts(c, tokens: int) -> float:
    E, k = c.num_experts, c.num_experts_per_tok
    return E * (1 - (1 - k / E) ** tokens)


def step_bytes(params, batch: int, ctx: float) -> float:
    c = params.config
    w = params.weights["params"]
    fixed = sum(x.nbytes for x in jax.tree.leaves(w)) - w["embed_tokens"]["embedding"].nbytes
    experts = sum(x.nbytes for path, x in jax.tree_util.tree_leaves_with_path(w)
                  if any(getattr(p, "key", None) == "experts" for p in path))
    used = fixed - experts
    if c.num_experts:
        used += c.num_layers * distinct_experts(c, batch) * 3 * c.hidden_size * c.moe_intermediate_size * 2
    kind = family_for(c).cache_kind(c)
    kv = 2 * len(c.full_layers) * batch * ctx * c.num_kv_heads * c.head_dim * 2
    return used + kv + 2 * batch * kind.state_bytes()


def pending_record(c, B: int, N: int, commit: str):
    """A random verification record of every linear layer (what `commit` consumes)."""
    Hk, Hv, Dk, Dv, Ch, C = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                             c.linear_value_head_dim, c.conv_dim, c.conv_kernel)
    key = jax.random.key(0)
    if commit == "checkpoint":
        rec = {"conv": jnp.zeros((B, N, C - 1, Ch), jnp.bfloat16), "ssm": jnp.zeros((B, N, Hv, Dk, Dv), jnp.float32)}
    else:
        rec = {"x": jnp.zeros((B, N, Ch), jnp.bfloat16), "k": jax.random.normal(key, (B, N, Hk, Dk), jnp.bfloat16),
               "v": jnp.zeros((B, N, Hv, Dv), jnp.bfloat16), "g": jnp.full((B, N, Hv), -0.1, jnp.float32),
               "beta": jnp.full((B, N, Hv), 0.5, jnp.float32)}
    return tuple(jax.tree.map(jnp.copy, rec) for _ in c.linear_layers)


def commit_time(c, B: int, N: int, commit: str, reps: int = 20) -> tuple[float, int]:
    """(seconds of one commit of every layer's states, bytes of the record): `reps` commits
    in one program (a loop whose every turn commits a full record of N accepted nodes), so
    that the call's dispatch of a few hundred arrays does not count."""
    kind = family_for(c).cache_kind(c)
    layout = CacheLayout(paged=False, capacity=64)
    record = pending_record(c, B, N, commit)
    record_bytes = sum(x.nbytes for x in jax.tree.leaves(record))
    path = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32)[None], (B, N))
    acc = jnp.full((B,), N, jnp.int32)

    def commits(cache, record, n):
        def one(_, cache):
            return kind.commit(cache.replace(pending=record), layout, None, jnp.zeros((B,), jnp.int32), path, acc,
                               jnp.ones((B,), bool), True)
        return jax.lax.fori_loop(0, n, one, cache)

    f = jax.jit(commits, static_argnums=2, donate_argnums=0)
    f(kind.init(layout, B), record, 1)
    t1 = median_time(lambda: f(kind.init(layout, B), record, 1), n=5)
    tn = median_time(lambda: f(kind.init(layout, B), record, reps + 1), n=5)
    return (tn - t1) / reps, record_bytes


def gpu_check():
    """Float32 greedy on the GPU through the kernels: a small random Qwen3.5 with a random
    MTP layer, plain against MTP chains and trees (dense and paged), and the kernels
    against the jnp references (`dispatch.use_backend("reference")`) -> identical prompts."""
    from benchmarks.common import _hybrid_types
    from jspec.kernels import dispatch
    c = QWEN35_27B.replace(vocab_size=4096, hidden_size=256, num_layers=8, layer_types=_hybrid_types(8),
                           num_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=16, linear_num_key_heads=2,
                           linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                           intermediate_size=512, dtype="float32")
    sharp = jax.jit(lambda w: jax.tree.map(lambda a: a * 4 if a.ndim >= 2 else a, w))
    target = random_params(c)
    target = jspec.Params(config=c, weights=sharp(target.weights))
    d = QwenMtpDraft(layer_config(c))
    with_mtp = target.with_draft(jspec.DraftParams(d, sharp(jax.jit(lambda k: d.init(k, c.vocab_size))(
        jax.random.key(1)))))
    ps = [list(range(5, 5 + n)) for n in (7, 30, 100)]
    kw = dict(max_new_tokens=48, stop_token_ids=[])
    res = {"env": env_info()}
    plain = jspec.generate(target, ps, **kw).tokens
    cases = {"chain_paged16": (jspec.SpecConfig(num_steps=3), jspec.CacheConfig("paged", page_size=16)),
             "tree_dense": (jspec.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6), jspec.CacheConfig("dense")),
             "tree_paged64": (jspec.SpecConfig(num_steps=3, topk=4, num_draft_tokens=8),
                              jspec.CacheConfig("paged", page_size=64))}
    cases["ngram_chain_paged16"] = (jspec.SpecConfig(num_steps=4), jspec.CacheConfig("paged", page_size=16))
    for name, (spec, cache) in cases.items():
        p = target.with_draft(jspec.NgramDraft()) if name.startswith("ngram") else with_mtp
        out = jspec.generate(p, ps, spec=spec, cache=cache, **kw)
        res[name] = {"identical": sum(a == b for a, b in zip(out.tokens, plain)), "of": len(ps),
                     "mean_accept_length": out.stats.mean_accept_length}
        print(name, res[name], flush=True)
    with dispatch.use_backend("reference"):
        jspec.clear_caches()
        ref = jspec.generate(target, ps, **kw).tokens
    jspec.clear_caches()
    res["kernels_vs_reference_plain"] = {"identical": sum(a == b for a, b in zip(ref, plain)), "of": len(ps)}
    print("kernels_vs_reference_plain", res["kernels_vs_reference_plain"], flush=True)
    save_json("qwen35_gpu_check.json", res)


def commit_only(c, shape: str):
    res = {"env": env_info(), "shape": shape}
    for batch in (1, 32):
        for commit in ("replay", "checkpoint"):
            try:
                t, nbytes = commit_time(c, batch, 4, commit)
                res[f"commit_b{batch}_{commit}"] = {"ms": t * 1e3, "record_MB": nbytes / 1e6}
            except Exception as e:  # noqa: BLE001
                res[f"commit_b{batch}_{commit}"] = {"failed": repr(e)[:300]}
            print(f"commit_b{batch}_{commit}", rounded(res[f"commit_b{batch}_{commit}"]), flush=True)
    save_json(f"qwen35_{shape}_commit.json", res)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES) + ["check"])
    ap.add_argument("parts", nargs="*", default=["decode", "mtp", "commit"])
    ap.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    args = ap.parse_args()
    if args.shape == "check":
        return gpu_check()
    c = SHAPES[args.shape]
    if args.parts == ["commit"]:  # the commit alone needs no weights
        return commit_only(c, args.shape)
    batches = [int(b) for b in args.batches.split(",")]
    name = f"qwen35_{args.shape}_b{'_'.join(map(str, batches))}.json"
    res = {"env": env_info(), "shape": args.shape}
    print(res["env"], flush=True)
    bw = copy_bandwidth()
    ceiling = ceiling_of(bw)
    res["copy_bandwidth"] = bw
    t0 = time.perf_counter()
    target = random_params(c)
    n = sum(x.size for x in jax.tree.leaves(target.weights))
    res["parameters"] = n
    print(f"{args.shape} ready in {time.perf_counter() - t0:.1f}s: {n / 1e9:.2f}B parameters; state "
          f"{family_for(c).cache_kind(c).state_bytes() / 1e6:.1f} MB a request", flush=True)

    def log(key, row):
        res[key] = row
        print(key, rounded(row), flush=True)
        save_json(name, res)

    ar = {}
    for batch in batches:
        r = Runner(target, prompts(batch, c.vocab_size), LONG)
        per, _, _ = r.per_round(SHORT, LONG, reps=2)
        ar[batch] = per
        nbytes = step_bytes(target, batch, CTX + (SHORT + LONG) / 2)
        log(f"decode_b{batch}", {"ms_per_step": per * 1e3, "ms_per_token": per * 1e3 / batch,
                                 "GB_moved_per_step": nbytes / 1e9, "bandwidth_util": nbytes / per / ceiling,
                                 "compile_s": r.compile_s})
        del r
    rounds = {}
    if {"mtp", "mtp3", "commit"} & set(args.parts):
        d = QwenMtpDraft(layer_config(c))
        dw = jax.jit(lambda k: d.init(k, c.vocab_size))(jax.random.key(1))
        spec_params = target.with_draft(jspec.DraftParams(d, dw))
        shapes = ([(1, 1, 2), (2, 1, 3)] if "mtp" in args.parts else []) + [(3, 1, 4), (3, 2, 4)]
        for batch in batches:
            for S, K, N in shapes:
                if batch == 32 and (S, K, N) in ((1, 1, 2), (2, 1, 3)):
                    continue
                for commit in ("replay", "checkpoint") if (S, K, N) == (3, 1, 4) and "commit" in args.parts \
                        else ("replay",):
                    try:
                        spec = jspec.SpecConfig(num_steps=S, topk=K, num_draft_tokens=N)
                        r = Runner(spec_params, prompts(batch, c.vocab_size), LONG, spec=spec,
                                   tuning=jspec.Tuning(recurrent_commit=commit))
                        per, _, _ = r.per_round(SHORT, LONG, reps=2)
                        rounds[batch, S, K, N, commit] = per
                        log(f"round_b{batch}_S{S}_K{K}_N{N}_{commit}", {
                            "ms_per_round": per * 1e3, "ratio_to_ar_step": per / ar[batch], "compile_s": r.compile_s})
                        del r
                    except Exception as e:  # noqa: BLE001 (an out-of-memory checkpoint record is a result)
                        log(f"round_b{batch}_S{S}_K{K}_N{N}_{commit}", {"failed": repr(e)[:300]})
    if "commit" in args.parts:
        for batch in (1, 32):
            for commit in ("replay", "checkpoint"):
                try:
                    t, nbytes = commit_time(c, batch, 4, commit)
                    per = rounds.get((batch, 3, 1, 4, commit))
                    log(f"commit_b{batch}_{commit}", {"ms": t * 1e3, "record_MB": nbytes / 1e6,
                                                      "share_of_round": t / per if per else None})
                except Exception as e:  # noqa: BLE001
                    log(f"commit_b{batch}_{commit}", {"failed": repr(e)[:300]})
    print("saved", save_json(name, res))


if __name__ == "__main__":
    main()
