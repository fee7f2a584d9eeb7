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

split: the hybrid split over n GPUs against one (`split_main`): a small Qwen3.5-MoE's
tokens through the kernels on n GPUs against one, and the Qwen3.5-122B-A10B shape cut to
--layers (48: the whole model): decode and the MTP chain on each GPU count of --gpus (default
1 and n), its random weights made split (`common.random_copies_split`: never whole on one GPU).
    PYTHONPATH=. python3 benchmarks/qwen35.py split [check] [decode] [--devices 2] [--layers 8] [--batches 1,32]
        [--precision highest] [--fp8] [--cases plain_paged16,chain_paged16,...] [--gpus 1,2] [--reps 2] [--no-mtp]
        [--prefill-block 256]
Result: $OUT/qwen35_split_<n>[_fp8].json

fp8: the Qwen3.5-27B shape cut to --layers decoding with bf16 weights and with the same
weights rounded to FP8 in device memory (`fp8_main`).
    PYTHONPATH=. python3 benchmarks/qwen35.py fp8 [--layers 16] [--batches 1,32]
Result: $OUT/qwen35_27b_fp8_L<layers>.json

gated_delta (options of its own): the Gated DeltaNet kernels of the linear-attention layers
on a GPU (`jspec.kernels.gated_delta.kernels`): each Pallas kernel checked against the jnp
references (float32 and bf16 inputs), then timed against the references compiled by XLA
and against flash-linear-attention's Triton kernels (`chunk_gated_delta_rule`,
`fused_recurrent_gated_delta_rule`) in the same process.

Sections (--sections, comma-separated, run in the order given; default sweep,check,time,fla):
  sweep  the kernels' tiles (`GatedDeltaTiles` fields: Dv tiles, warps, stages, chunk,
         product precision, split verify) at one shape each, with each variant's error;
         the fastest within --tol (2e-5) of the float32 reference is what the check and
         time sections then run (the defaults otherwise)
  check  kernel vs `gated_delta_reference` (the sequential rule, float32 products) and
         the XLA chunk references: ||out - ref|| / ||ref|| and of the state
  time   us per call of each entry point (kernel) and its XLA reference: GPU kernel time
         (every kernel of the call: the wrapper's pads and ancestor matrix too, split by
         kernel) from a profiler trace, the mean of 4 calls each on its own inputs (so
         nothing comes from L2 that a real call would read cold)
  fla    FLA's kernels at the same shapes (--fla: a directory holding the `fla` package,
         put on sys.path; torch CUDA kernel time from torch.profiler, same method, and its
         split by kernel), and their error against the same reference
Shapes: Hk = 16, Dk = Dv = 128, Hv = 32 (48 where named), B in {1, 32}, N in {1, 4, 8, 16,
64} verified nodes (trees with random parents; chains where FLA is compared), prefill T =
4096 and 32768 (B = 1, Hv 32 and 48). The prefill's check and time rows are one per form
(`PREFILL_FORMS`, --forms: the scan form and the split form with each product precision
and intermediates' dtype), plus the sweep's pick. --kernels: the entry points to run
(e.g. prefill). --smoke: tiny shapes, a CPU run of the whole section list in interpret mode.

     PYTHONPATH=. python3 benchmarks/qwen35.py gated_delta [--sections sweep,check,time,fla] [--fla DIR] [--budget S]
         [--kernels verify,decode,replay,prefill] [--forms scan,split,...]
Results: $OUT/gated_delta_<device>.json (rows as they come) and a table on stdout.

prefill: one Qwen3.5-27B prompt of each length (default 4096 32768 131072) through one
program compiled for the longest (`common.prefill_bench`), seconds, tokens/s and MFU;
--kernel-blocks: the full-attention layers' prompt blocks through the Pallas cache kernel
instead of cuDNN. transformers_prefill: transformers' Qwen3_5ForCausalLM of the same shape,
one sdpa forward a length (in a process of its own; with DIR, an unpacked fla-core wheel,
on PYTHONPATH it runs fla's chunked gated-delta kernels).
    PYTHONPATH=. python3 benchmarks/qwen35.py prefill [4096 32768 131072] [--kernel-blocks]
    PYTHONPATH=.:DIR python3 benchmarks/qwen35.py transformers_prefill [4096 32768]
Results: $OUT/prefill_qwen35_27b.json, $OUT/transformers_prefill_qwen35_27b.json
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from benchmarks.common import (CTX, QWEN35_122B_A10B, QWEN35_27B, QWEN35_35B_A3B, Runner, ceiling_of, copy_bandwidth, env_info,
                               hybrid_types, median_time, prefill_bench, program_temp_GB, prompts, random_copies_split,
                               random_params, rounded, save_json, trace_events, traced, transformers_prefill_bench)
from jspec.cache.layout import CacheLayout
from jspec.kernels.attention.decode import AttentionTiles
from jspec.drafts.qwen_mtp import QwenMtpDraft, layer_config
from jspec.kernels.gated_delta import reference as gd
from jspec.kernels.gated_delta import kernels as gk
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


def small_model(moe: bool = False):
    """(target, target with a random MTP layer): a small random float32 Qwen3.5 (8 layers of
    256; moe: Qwen3.5-MoE with 16 experts of 64, 4 a token, and a shared one), weights
    scaled up so that its greedy choices are not near ties."""
    small = dict(vocab_size=4096, hidden_size=256, num_layers=8, layer_types=hybrid_types(8), num_heads=4,
                 num_kv_heads=2, head_dim=64, rotary_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=64, linear_value_head_dim=64, dtype="float32")
    if moe:
        c = QWEN35_35B_A3B.replace(**small, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
                                   shared_expert_intermediate_size=64)
    else:
        c = QWEN35_27B.replace(**small, intermediate_size=512)
    sharp = jax.jit(lambda w: jax.tree.map(lambda a: a * 4 if a.ndim >= 2 else a, w))
    target = random_params(c)
    target = jspec.Params(config=c, weights=sharp(target.weights))
    d = QwenMtpDraft(layer_config(c))
    return target, target.with_draft(jspec.DraftParams(d, sharp(jax.jit(lambda k: d.init(k, c.vocab_size))(
        jax.random.key(1)))))


CHECK_PROMPTS = [list(range(5, 5 + n)) for n in (7, 30, 100)]
CHECK_CASES = {"chain_paged16": (jspec.SpecConfig(num_steps=3), jspec.CacheConfig("paged", page_size=16)),
               "tree_dense": (jspec.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6), jspec.CacheConfig("dense")),
               "tree_paged64": (jspec.SpecConfig(num_steps=3, topk=4, num_draft_tokens=8),
                                jspec.CacheConfig("paged", page_size=64)),
               "ngram_chain_paged16": (jspec.SpecConfig(num_steps=4), jspec.CacheConfig("paged", page_size=16))}


def gpu_check():
    """Float32 greedy on the GPU through the kernels: a small random Qwen3.5 with a random
    MTP layer, plain against MTP chains and trees (dense and paged), and the kernels
    against the jnp references (`dispatch.use_backend("reference")`) -> identical prompts."""
    from jspec.kernels import dispatch
    target, with_mtp = small_model()
    ps = CHECK_PROMPTS
    kw = dict(max_new_tokens=48, stop_token_ids=[])
    res = {"env": env_info()}
    plain = jspec.generate(target, ps, **kw).tokens
    for name, (spec, cache) in CHECK_CASES.items():
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


def split_main(argv):
    """`split`: the hybrid split over n GPUs (`models.qwen3_next_split`) against one GPU.
    check: the small random Qwen3.5-MoE (float32, through the kernels) on n GPUs against one,
    plain, MTP chains and trees and an n-gram chain: identical prompts. decode: the
    Qwen3.5-122B-A10B shape cut to --layers, random bf16 weights made split
    (`random_copies_split`), on each GPU count of --gpus (default 1 and n): its weights' bytes,
    ms/step at --batches (context 1k) and the MTP chain S=3 round (batch 1; not with
    --no-mtp) as a ratio to its step, each the best of --reps pairs of runs, with each
    program's temporaries (XLA's memory analysis); --prefill-block: the prompts' pass in blocks
    of that many tokens (`Tuning.prefill_block`); --max-batched-tokens: at most that many a
    pass (`Tuning.max_batched_tokens`). --fp8: the
    target's projections and experts rounded to FP8 in device memory (`quantize_params`);
    --cases: the check's cases (default all)."""
    from jspec.quantization import quantize_params
    ap = argparse.ArgumentParser(prog="qwen35.py split")
    ap.add_argument("parts", nargs="*", default=["check", "decode"])
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--precision", default="default", help="jax.default_matmul_precision of the check")
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--cases", default="", help="comma-separated check cases (default: all)")
    ap.add_argument("--gpus", default="", help="decode's GPU counts, comma-separated (default: 1 and --devices)")
    ap.add_argument("--reps", type=int, default=2, help="decode: pairs of runs a row, the best kept")
    ap.add_argument("--no-mtp", action="store_true", help="decode: no MTP chain rows")
    ap.add_argument("--prefill-block", type=int, default=None, help="decode: `Tuning.prefill_block` (default: its default)")
    ap.add_argument("--max-batched-tokens", type=int, default=None,
                    help="decode: `Tuning.max_batched_tokens` (default: its default)")
    args = ap.parse_args(argv)
    n = args.devices
    res = {"env": env_info(), "devices": n, "fp8": args.fp8}
    name = f"qwen35_split_{n}{'_fp8' if args.fp8 else ''}.json"

    def fp8(p):  # the target's projections FP8 (the draft as it is), or p
        return dataclasses.replace(quantize_params(p), draft=p.draft) if args.fp8 else p

    def log(key, row):
        res[key] = row
        print(key, rounded(row), flush=True)
        save_json(name, res)

    if "check" in args.parts:
        target, with_mtp = small_model(moe=True)
        target, with_mtp = fp8(target), fp8(with_mtp)
        kw = dict(max_new_tokens=48, stop_token_ids=[])
        cases = {"plain_paged16": (None, jspec.CacheConfig("paged", page_size=16)),
                 "plain_dense": (None, jspec.CacheConfig("dense")), **CHECK_CASES}
        for case, (spec, cache) in cases.items():
            if args.cases and case not in args.cases.split(","):
                continue
            p = target.with_draft(jspec.NgramDraft()) if case.startswith("ngram") else with_mtp
            with jax.default_matmul_precision(args.precision):
                one = jspec.generate(p, CHECK_PROMPTS, spec=spec, cache=cache, **kw)
                split = jspec.generate(jspec.shard(p, n), CHECK_PROMPTS, spec=spec, cache=cache, **kw)
            same = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                    for a, b in zip(one.tokens, split.tokens)]
            log(f"check_{case}_{args.precision}", {
                "identical": same.count(None), "of": len(CHECK_PROMPTS), "first_difference": same,
                "mean_accept_length": split.stats.mean_accept_length})
        del target, with_mtp
        jspec.clear_caches()
    if "decode" in args.parts:
        c = QWEN35_122B_A10B.replace(num_layers=args.layers, layer_types=hybrid_types(args.layers))

        given = {k: v for k, v in (("prefill_block", args.prefill_block), ("max_batched_tokens", args.max_batched_tokens))
                 if v is not None}
        tuning = jspec.Tuning(**given) if given else None

        def mtp_layer(c):
            d = QwenMtpDraft(layer_config(c))
            return jspec.DraftParams(d, jax.jit(lambda k: d.init(k, c.vocab_size))(jax.random.key(1)))
        for devices in [int(g) for g in (args.gpus or f"1,{n}").split(",")]:
            t0 = time.perf_counter()
            p = random_copies_split(c, devices, fp8=args.fp8, draft=mtp_layer)
            res[f"weights_gpus{devices}"] = {
                "parameters": sum(x.size for x in jax.tree.leaves(p.weights)),
                "target_GB": sum(x.nbytes for x in jax.tree.leaves(p.weights)) / 1e9,
                "mtp_GB": sum(x.nbytes for x in jax.tree.leaves(p.draft.weights)) / 1e9,
                "made_s": time.perf_counter() - t0}
            print(f"weights_gpus{devices}", rounded(res[f"weights_gpus{devices}"]), flush=True)
            for batch in [int(b) for b in args.batches.split(",")]:
                t0 = time.perf_counter()
                r = Runner(dataclasses.replace(p, draft=None), prompts(batch, c.vocab_size), LONG,
                           tuning=tuning)  # plain decoding
                temp_GB = program_temp_GB(r.prog)
                per, _, _ = r.per_round(SHORT, LONG, reps=args.reps)
                log(f"decode_gpus{devices}_b{batch}", {"ms_per_step": per * 1e3, "compile_s": r.compile_s,
                                                       "temp_GB": temp_GB, "wall_s": time.perf_counter() - t0})
                del r
                if batch == 1 and not args.no_mtp:
                    r = Runner(p, prompts(1, c.vocab_size), LONG, spec=jspec.SpecConfig(num_steps=3), tuning=tuning)
                    rper, _, _ = r.per_round(SHORT, LONG, reps=args.reps)
                    log(f"mtp_chain3_gpus{devices}_b1", {"ms_per_round": rper * 1e3, "ratio_to_step": rper / per,
                                                         "compile_s": r.compile_s, "temp_GB": program_temp_GB(r.prog)})
                    del r
            del p
            jspec.clear_caches()
    print("saved", save_json(name, res))


def fp8_main(argv):
    """`fp8`: the Qwen3.5-27B shape cut to --layers, random bf16 weights, decoding at
    --batches (context 1k) with those weights and with them rounded to FP8 in device
    memory (`quantization.quantize_params`: every projection, the embedding and LM head
    left bf16), in one process: ms/step and the FP8 / bf16 ratio."""
    from jspec.quantization import quantize_params
    ap = argparse.ArgumentParser(prog="qwen35.py fp8")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--batches", default="1,32")
    args = ap.parse_args(argv)
    c = QWEN35_27B.replace(num_layers=args.layers, layer_types=hybrid_types(args.layers))
    res = {"env": env_info(), "layers": args.layers}
    name = f"qwen35_27b_fp8_L{args.layers}.json"
    bf16 = random_params(c)
    ms = {}
    for label, p in (("bf16", bf16), ("fp8", quantize_params(bf16))):
        res[f"weight_GB_{label}"] = sum(x.nbytes for x in jax.tree.leaves(p.weights)) / 1e9
        for batch in [int(b) for b in args.batches.split(",")]:
            r = Runner(p, prompts(batch, c.vocab_size), LONG)
            per, _, _ = r.per_round(SHORT, LONG, reps=2)
            ms[label, batch] = per * 1e3
            res[f"decode_{label}_b{batch}"] = {"ms_per_step": per * 1e3, "compile_s": r.compile_s}
            if label == "fp8":
                res[f"decode_fp8_b{batch}"]["speedup_over_bf16"] = ms["bf16", batch] / ms["fp8", batch]
            print(f"decode_{label}_b{batch}", rounded(res[f"decode_{label}_b{batch}"]), flush=True)
            save_json(name, res)
            del r
    print("saved", save_json(name, res))


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


# --------------------------------------------------------------------------- gated_delta

# the gated_delta subcommand's state (set by `gated_delta_main`)
Hk, Dk, Dv = 16, 128, 128
ROWS: list[dict] = []
KINDS: list[str] = []  # --kernels
START = 0.0
ARGS = None
ENV: dict = {}


def left() -> float:
    return ARGS.budget - (time.time() - START)


def record(row: dict):
    ROWS.append(row)
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    save_json(f"gated_delta_{ENV['device'].replace(' ', '_')}.json", {"env": ENV, "args": vars(ARGS), "rows": ROWS})


def sz(B: int, T: int, Hv: int):
    """(B, T, Hv) as given, or shrunk by --smoke (a CPU run of the script in interpret mode)."""
    if not ARGS.smoke:
        return B, T, Hv
    return min(B, 2), min(T, 70), max(Hv // 8, 2)


def inputs(seed: int, B: int, T: int, Hv: int, dtype, *, state_scale: float = 0.1):
    """Random q, k [B, T, Hk, Dk], v [B, T, Hv, Dv] of dtype, g (log decay: -softplus), beta
    (sigmoid) [B, T, Hv] float32 and state [B, Hv, Dk, Dv] float32 (fresh values per seed)."""
    B, T, Hv = sz(B, T, Hv)
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (B, T, Hk, Dk), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (B, T, Hk, Dk), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (B, T, Hv, Dv), jnp.float32).astype(dtype)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, Hv), jnp.float32) - 2.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, Hv), jnp.float32))
    state = state_scale * jax.random.normal(ks[5], (B, Hv, Dk, Dv), jnp.float32)
    return q, k, v, g, beta, state


def tree(seed: int, B: int, N: int, chain: bool = False):
    """parents [B, N]: node 0 the root (-1), node t's parent uniform in [0, t) (chain: t - 1)."""
    B, N, _ = sz(B, N, 2)
    if chain:
        return gd.chain_parents(B, N)
    rng = np.random.RandomState(seed)
    return jnp.asarray(np.stack([[-1] + [rng.randint(0, t) for t in range(1, N)] for _ in range(B)]).astype(np.int32))


def rel(a, b) -> float:
    if np.size(a) > 1 << 24:  # on the device, in float32 (a prefill of 32k tokens: GBs in float64 on the host)
        a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
        if not bool(jnp.all(jnp.isfinite(a))):
            return float("nan")
        return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.all(np.isfinite(a)):
        return float("nan")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def highest(f):
    """f traced with float32 products (XLA would take TF32 on the GPU)."""
    @functools.wraps(f)
    def g(*a, **kw):
        with jax.default_matmul_precision("highest"):
            return f(*a, **kw)
    return g


def kernel_check():
    ref_seq = jax.jit(highest(lambda q, k, v, g, b, s, p: gd.gated_delta_reference(q, k, v, g, b, s, p)[0]))
    ref_steps = jax.jit(highest(gd.gated_delta_steps_reference))
    ref_tree = jax.jit(highest(gd.gated_delta_tree_chunk_reference))
    ref_chunk = jax.jit(highest(gd.gated_delta_chunk_reference))
    verify = jax.jit(functools.partial(gk.gated_delta_verify_kernel, **TUNED.get("verify", {})))
    step = jax.jit(functools.partial(gk.gated_delta_step_kernel, **TUNED.get("decode", {})))
    step_noq = jax.jit(functools.partial(gk.gated_delta_step_kernel, None, **TUNED.get("decode", {})))
    print(f"check: tiles {TUNED}", flush=True)
    seed = 100
    f32, bf16 = jnp.float32, jnp.bfloat16
    for B, N, Hv, chain, dtype in ((1, 16, 32, False, f32), (32, 8, 32, False, bf16), (4, 16, 48, False, bf16),
                                   (2, 64, 32, False, f32), (2, 1, 32, True, bf16)):
        if "verify" not in KINDS:
            break
        if left() < 150:
            print("check: out of budget", flush=True)
            return
        seed += 1
        x, p = inputs(seed, B, N, Hv, dtype), tree(seed, B, N, chain)
        want = ref_seq(*x, p)
        got = verify(*x, p)
        record({"section": "check", "kernel": "verify", "dtype": jnp.dtype(dtype).name, "B": B, "N": N, "Hv": Hv,
                "shape": "chain" if chain else "tree", "err": rel(got, want), "xla_tree_err": rel(ref_tree(*x, p), want)})
    for B, T, Hv, kind, dtype in ((32, 1, 32, "decode", bf16), (32, 4, 32, "replay", f32), (2, 4, 48, "steps", bf16)):
        if not {"decode", "replay"} & set(KINDS):
            break
        seed += 1
        x = inputs(seed, B, T, Hv, dtype)
        count = None if kind == "decode" else jnp.asarray(
            np.random.RandomState(seed).randint(0, T + 1, x[0].shape[0]), jnp.int32)
        want_o, want_s = ref_steps(*x, count)
        if kind == "replay":
            got_o, got_s = step_noq(*x[1:], count)
        else:
            got_o, got_s = step(*x, count)
        record({"section": "check", "kernel": "step", "dtype": jnp.dtype(dtype).name, "B": B, "T": T, "Hv": Hv,
                "shape": kind, "err": float("nan") if got_o is None else rel(got_o, want_o),
                "state_err": rel(got_s, want_s)})
    for B, T, Hv, lengths, dtype in ((1, 4096, 32, None, bf16), (2, 1000, 48, (1000, 517), f32),
                                     (1, 32768, 32, None, bf16)):
        if "prefill" not in KINDS:
            break
        if left() < 100:
            print("check: out of budget", flush=True)
            return
        seed += 1
        x = inputs(seed, B, T, Hv, dtype)
        ln = None if lengths is None else jnp.asarray(lengths[:x[0].shape[0]], jnp.int32) % (x[0].shape[1] + 1)
        want_o, want_s = ref_steps(*x, ln)
        valid = None if ln is None else np.asarray(gd.valid_tokens(x[0].shape[1], ln, x[0].shape[0]))

        def on_valid(o, valid=valid):  # the outputs of real tokens (the padding's read the final state)
            return o if valid is None else np.asarray(o)[valid]

        base = {"section": "check", "kernel": "prefill", "dtype": jnp.dtype(dtype).name, "B": B, "T": T, "Hv": Hv,
                "lengths": str(lengths)}
        if T <= 4096:
            xo, xs = ref_chunk(*x, ln)
            record({**base, "form": "xla_chunk", "err": rel(on_valid(xo), on_valid(want_o)), "state_err": rel(xs, want_s)})
            del xo, xs
        for form, kw in prefill_forms().items():
            if left() < 60:
                print("check: out of budget", flush=True)
                return
            try:
                got_o, got_s = jax.jit(functools.partial(gk.gated_delta_prefill_kernel, **kw))(*x, ln)
                record({**base, "form": form, "err": rel(on_valid(got_o), on_valid(want_o)),
                        "state_err": rel(got_s, want_s), "tiles": kw})
                del got_o, got_s
            except Exception as e:  # noqa: BLE001 (a form that does not compile is a result)
                record({**base, "form": form, "tiles": kw, "error": repr(e)[:300]})


def grouped_us(groups, calls: int = 4) -> list[tuple[float, dict]]:
    """GPU kernel time (us) a call of each group and its split by kernel ({name: us}; XLA's
    own kernels under "xla"), one profiler trace a group: groups [(fn, make)], make(i) ->
    the arguments of call i (fresh inputs each call: states may be donated, and nothing a
    cold call would read comes from L2). Each fn is called once first (compile, warm-up),
    then `calls` times under the profiler; every GPU kernel of the trace counts."""
    for i, (fn, make) in enumerate(groups):
        jax.block_until_ready(fn(*make(10_000 + i)))
    out = []
    for i, (fn, make) in enumerate(groups):
        args = jax.block_until_ready([make(1 + c + calls * i) for c in range(calls)])
        _, d = traced(lambda: [fn(*a) for a in args])  # noqa: B023 (traced calls it at once)
        split: dict = {}
        for evs in trace_events(d).values():
            for _, name, _, dur in evs:
                key = name[:48] if "gated_delta" in name else "xla"
                split[key] = split.get(key, 0.0) + dur / 1e3 / calls
        out.append((sum(split.values()), {k: round(v, 2) for k, v in split.items()}))
    return out


def shapes():
    """(kind, B, T, Hv, extra) of the timed shapes (of the kinds in --kernels)."""
    out = [("verify", B, N, 32, "tree") for B in (1, 32) for N in (4, 8, 16)]
    out += [("verify", 32, 8, 48, "tree")]
    out += [("decode", B, 1, Hv, "") for B in (1, 32) for Hv in (32, 48)]
    out += [("replay", B, 4, 32, "count") for B in (1, 32)]
    out += [("prefill", 1, T, Hv, "") for T in PREFILL_T for Hv in (32, 48)]
    return [s for s in out if s[0] in KINDS]


PREFILL_T = (4096, 32768)
# The prefill's forms the check and time sections run (`GatedDeltaTiles` fields; --forms picks):
# the scan; the split form with the default tiles (for 16-bit inputs FLA's numerics, bf16
# products and intermediates, with the prep in two kernels, the state kernel on raw keys, its
# tile chosen by the grid, the output kernel's loop over the key dim), the same named, with the
# decayed keys instead of raw ones, one prep kernel, and the output kernel's other tiles; the
# split form with float32 intermediates and bf16x3 (the default for float32 inputs), tf32
# products, bfloat16 intermediates, the prep in two kernels or the output kernel's tiles of 128;
# and the scan with one-pass bf16 products.
SCAN = {"prefill_form": "scan"}
SPLIT_BF16 = {"prefill_form": "split", "prefill_precision": "bf16", "prefill_split_dtype": "bfloat16"}
SPLIT_F32 = {"prefill_form": "split", "prefill_split_dtype": "float32"}
PREFILL_FORMS = {
    "scan": SCAN,
    "split": {},
    "split_f32": SPLIT_F32,
    "split_bf16io": {**SPLIT_F32, "prefill_split_dtype": "bfloat16", "prefill_precision": "bf16x3"},
    "split_tf32": {**SPLIT_F32, "prefill_precision": "tf32"},
    "split_bf16": SPLIT_BF16,
    "split_bf16_prep1": {**SPLIT_BF16, "prefill_prep_split": False, "prefill_block_v": 32,
                         "prefill_kd_transposed": False},
    "split_prep2": {**SPLIT_F32, "prefill_prep_split": True},
    "split_bf16_kd": {**SPLIT_BF16, "prefill_raw_keys": False},
    "split_bf16_out64": {**SPLIT_BF16, "prefill_out_block_v": 64, "prefill_out_block_k": 128, "prefill_out_stages": 1},
    "split_bf16_out64k64": {**SPLIT_BF16, "prefill_out_block_v": 64, "prefill_out_block_k": 64},
    "split_bf16_out128w8": {**SPLIT_BF16, "prefill_out_warps": 8},
    "split_bf16_out128k64s2": {**SPLIT_BF16, "prefill_out_block_k": 64, "prefill_out_stages": 2},
    "split_bf16_out128k16s4": {**SPLIT_BF16, "prefill_out_block_k": 16, "prefill_out_stages": 4},
    "split_bf16_out128k32s4": {**SPLIT_BF16, "prefill_out_block_k": 32, "prefill_out_stages": 4},
    "split_bf16_out128k32s2": {**SPLIT_BF16, "prefill_out_block_k": 32, "prefill_out_stages": 2},
    "split_f32_out128": {**SPLIT_F32, "prefill_out_block_v": 128, "prefill_out_block_k": 64, "prefill_out_stages": 2},
    "scan_bf16": {**SCAN, "prefill_precision": "bf16"},
}


def prefill_forms() -> dict:
    """{name: tile fields} of the prefill forms in --forms, and "swept" (the sweep's pick) if any."""
    forms = {name: kw for name, kw in PREFILL_FORMS.items() if name in ARGS.forms.split(",")}
    if TUNED.get("prefill"):
        forms["swept"] = TUNED["prefill"]
    return forms


def fns(kind: str, tiles=None, **kw):
    """(kernel fn, reference fn) of an entry point, jitted; the state donated where the
    kernel updates it in place."""
    if kind == "verify":
        return (jax.jit(functools.partial(gk.gated_delta_verify_kernel, tiles=tiles, **kw)),
                jax.jit(gd.gated_delta_tree_chunk_reference))
    if kind == "decode":
        return (jax.jit(functools.partial(gk.gated_delta_step_kernel, tiles=tiles, **kw), donate_argnums=5),
                jax.jit(gd.gated_delta_steps_reference, donate_argnums=5))
    if kind == "replay":
        return (jax.jit(functools.partial(gk.gated_delta_step_kernel, None, tiles=tiles, **kw), donate_argnums=4),
                jax.jit(functools.partial(gd.gated_delta_steps_reference, None), donate_argnums=4))
    return (jax.jit(functools.partial(gk.gated_delta_prefill_kernel, tiles=tiles, **kw), donate_argnums=5),
            jax.jit(gd.gated_delta_chunk_reference, donate_argnums=5))


def arg_sets(kind: str, B: int, T: int, Hv: int, dtype=jnp.bfloat16):
    def make(i):
        x = inputs(1000 + i, B, T, Hv, dtype)
        if kind == "verify":
            return (*x, tree(i, B, T))
        if kind == "replay":
            return (*x[1:], jnp.asarray(np.random.RandomState(i).randint(1, T + 1, x[0].shape[0]), jnp.int32))
        return (*x, None)
    return make


def timing():
    for kind, B, T, Hv, _ in shapes():
        if left() < 60:
            print(f"time: out of budget at {kind} B={B} T={T}", flush=True)
            return
        if kind == "prefill":
            time_prefill(B, T, Hv)
            continue
        kern, ref = fns(kind, **TUNED.get(kind, {}))
        make = arg_sets(kind, B, T, Hv)
        (k_us, split), (r_us, _) = grouped_us([(kern, make), (ref, make)])
        row = {"section": "time", "kernel": kind, "B": B, "T": T, "Hv": Hv, "pallas_us": k_us, "xla_ref_us": r_us,
               "tiles": TUNED.get(kind, {}), "split": split}
        # the state's bytes read and written (and read only, by verify) over the time: the floor
        state_bytes = B * Hv * Dk * Dv * 4 * (1 if kind == "verify" else 2)
        row["state_GBps"] = state_bytes / max(row["pallas_us"], 1e-9) / 1e3
        record(row)


def time_prefill(B: int, T: int, Hv: int):
    """One row per prefill form (--forms) at this shape, writing bf16 outputs as the model
    does, each form's kernels timed in a trace of their own, with the XLA chunk reference
    (T <= 4096 only: 32k tokens take it long)."""
    make = arg_sets("prefill", B, T, Hv)
    groups, names = [], []
    for form, kw in prefill_forms().items():
        kern = fns("prefill", out_dtype=jnp.bfloat16, **kw)[0]  # the outputs in bf16, as the model (and FLA) writes them
        try:
            jax.block_until_ready(kern(*make(20_000)))  # compile here: a form that fails is a row, not the end
        except Exception as e:  # noqa: BLE001
            record({"section": "time", "kernel": "prefill", "form": form, "B": B, "T": T, "Hv": Hv, "tiles": kw,
                    "error": repr(e)[:300]})
            continue
        groups.append((kern, make))
        names.append((form, kw))
    with_ref = T <= 4096
    if with_ref:
        groups.append((fns("prefill")[1], make))
    if not groups:
        return
    res = grouped_us(groups)
    r_us = res[-1][0] if with_ref else float("nan")
    for (form, kw), (us, split) in zip(names, res):
        record({"section": "time", "kernel": "prefill", "form": form, "B": B, "T": T, "Hv": Hv, "pallas_us": us,
                "xla_ref_us": r_us, "tiles": kw, "split": split,
                "state_GBps": B * Hv * Dk * Dv * 4 * 2 / max(us, 1e-9) / 1e3})


TUNED: dict = {}  # kind -> the tile fields the sweep found fastest (within --tol of the reference)


def sweep():
    """Variants of the kernels' tiles (`GatedDeltaTiles` fields) at one shape each; the
    fastest whose error stays within --tol is what the check and time sections then run."""
    def v(**kw):
        return kw
    grid = {
        ("verify", 32, 16, 32): [
            v(), v(precision="tf32x3"), v(precision="bf16x6"), v(verify_state_xla=True), v(verify_block_v=64),
            v(verify_split=False), v(precision="tf32")],
        ("decode", 32, 1, 32): [v(step_block_v=bv, step_warps=w, step_stages=st)
                                for bv, w, st in ((64, 4, 1), (32, 2, 3), (32, 4, 1))],
        ("prefill", 1, 4096, 32): [
            v(**SCAN), v(**SCAN, precision="tf32x3"), v(**SCAN, prefill_stages=1), v(**SCAN, prefill_block_v=16),
            v(**SCAN, prefill_block_v=64), v(**SCAN, prefill_w=True, prefill_stages=1),
            v(**SCAN, chunk_prep_warps=2), v(**SCAN, prefill_chunk=32), v(**SCAN, prefill_blocked=False),
            v(**SCAN, precision="tf32")] + [
            # the split form (FLA's decomposition): float32 intermediates, bf16x3 products ...
            v(**SPLIT_F32), v(**SPLIT_F32, prefill_state_stages=1), v(**SPLIT_F32, prefill_block_v=16), v(**SPLIT_F32, prefill_block_v=64),
            v(**SPLIT_F32, chunk_prep_warps=8), v(**SPLIT_F32, prefill_out_block_v=128, prefill_out_warps=8),
            v(**SPLIT_F32, prefill_out_block_v=32), v(**SPLIT_F32, prefill_precision="tf32"),
            # ... bfloat16 intermediates; with one-pass bf16 products (FLA's precision) and its tiles
            v(**SPLIT_F32, prefill_split_dtype="bfloat16", prefill_precision="bf16x3"),
            v(**SPLIT_BF16), v(**SPLIT_BF16, prefill_state_stages=3),
            v(**SPLIT_BF16, prefill_block_v=16), v(**SPLIT_BF16, prefill_block_v=64),
            v(**SPLIT_BF16, prefill_warps=2), v(**SPLIT_BF16, chunk_prep_warps=2), v(**SPLIT_BF16, chunk_prep_warps=8),
            v(**SPLIT_BF16, prefill_out_block_v=128, prefill_out_warps=8), v(**SPLIT_BF16, prefill_out_block_v=32),
            v(**SPLIT_BF16, prefill_chunk=32), v(**SPLIT_BF16, prefill_blocked=False)],
    }
    bases = {PREFILL_FORMS[f].get("prefill_form", "split") for f in ARGS.forms.split(",") if f in PREFILL_FORMS}
    grid["prefill", 1, 4096, 32] = [kw for kw in grid["prefill", 1, 4096, 32]
                                    if kw.get("prefill_form", "split") in bases]
    for (kind, B, T, Hv), variants in grid.items():
        if kind not in KINDS:
            continue
        if left() < 60:
            print("sweep: out of budget", flush=True)
            return
        make = arg_sets(kind, B, T, Hv)
        want = jax.jit(highest(fns(kind)[1]))(*make(999))
        ok, errs = [], []
        for kw in variants:
            if left() < 60:
                print("sweep: out of budget", flush=True)
                break
            kern = fns(kind, **kw)[0]
            try:
                got = kern(*make(999))
            except Exception as e:  # noqa: BLE001
                record({"section": "sweep", "kernel": kind, "B": B, "T": T, "Hv": Hv, **kw, "error": repr(e)[:300]})
                continue
            # err: the state's (the outputs' for verify); the prefill's outputs too (out_err)
            errs.append({"err": rel(got if kind == "verify" else got[1], want if kind == "verify" else want[1])}
                        | ({"out_err": rel(got[0], want[0])} if kind == "prefill" else {}))
            del got
            ok.append((kw, kern))
        best = None
        for (kw, _), e, (us, split_us) in zip(ok, errs, grouped_us([(f, make) for _, f in ok]) if ok else []):
            err = max(e.values())
            record({"section": "sweep", "kernel": kind, "B": B, "T": T, "Hv": Hv, **kw, "us": us, **e,
                    "split": split_us})
            if err <= ARGS.tol and (best is None or us < best[0]):
                best = (us, kw)
        if best is not None:
            for k in (("decode", "replay") if kind == "decode" else (kind,)):
                TUNED[k] = best[1]
            print(f"sweep: {kind} runs {best[1]} from here on", flush=True)


def fla():
    if ARGS.fla:
        sys.path.insert(0, ARGS.fla)
    import torch
    from fla.ops.gated_delta_rule import (
        chunk_gated_delta_rule,
        fused_recurrent_gated_delta_rule,
    )

    def to_torch(a):
        return torch.from_numpy(np.asarray(a.astype(jnp.float32))).cuda()

    def torch_sets(kind, B, T, Hv, i):
        q, k, v, g, beta, state = inputs(1000 + i, B, T, Hv, jnp.bfloat16)
        bf = torch.bfloat16
        return (to_torch(q).to(bf), to_torch(k).to(bf), to_torch(v).to(bf), to_torch(g), to_torch(beta),
                to_torch(state))

    beta_dtype = [torch.float32]  # FLA may want beta in q's dtype: switched on the first failure

    def call(fn, q, k, v, g, beta, state):
        try:
            return fn(q, k, v, g=g, beta=beta.to(beta_dtype[0]), initial_state=state, output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
        except Exception:
            if beta_dtype[0] != torch.float32:
                raise
            beta_dtype[0] = q.dtype
            print("fla: float32 beta failed; beta in q's dtype", flush=True)
            return call(fn, q, k, v, g, beta, state)

    def kernel_us(fn, make, reps):
        """(median us a call, {kernel name: us a call} of the median rep): FLA's kernels split."""
        from torch.profiler import ProfilerActivity, profile
        call(fn, *make(0))
        torch.cuda.synchronize()
        per = []
        for r in range(reps):
            sets = [make(1 + r * 4 + i) for i in range(4)]
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for a in sets:
                    call(fn, *a)
                torch.cuda.synchronize()
            split = {e.key[:60]: getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) / len(sets)
                     for e in prof.key_averages()}
            per.append((sum(split.values()), {k: v for k, v in split.items() if v > 0}))
        per.sort(key=lambda x: x[0])
        return float(per[len(per) // 2][0]), per[len(per) // 2][1]

    ref_steps = jax.jit(highest(gd.gated_delta_steps_reference))
    cases = [("chunk", chunk_gated_delta_rule, "verify", B, N, 32) for B in (1, 32) for N in (4, 16)]
    cases += [("recurrent", fused_recurrent_gated_delta_rule, "verify", B, N, 32) for B, N in ((1, 4), (32, 4), (32, 16))]
    cases += [("recurrent", fused_recurrent_gated_delta_rule, "decode", B, 1, Hv) for B in (1, 32) for Hv in (32, 48)]
    cases += [("chunk", chunk_gated_delta_rule, "prefill", 1, T, Hv) for T in PREFILL_T for Hv in (32, 48)]
    for name, fn, kind, B, T, Hv in cases:
        if kind not in KINDS:
            continue
        if left() < 30:
            print("fla: out of budget", flush=True)
            return
        make = functools.partial(torch_sets, kind, B, T, Hv)
        try:
            o, s = call(fn, *make(7))
            want_o, want_s = ref_steps(*inputs(1007, B, T, Hv, jnp.bfloat16))
            err = rel(o.float().cpu().numpy(), want_o)
            serr = rel(s.float().cpu().numpy(), want_s)
            us, split = kernel_us(fn, make, ARGS.reps)
        except Exception as e:  # noqa: BLE001
            record({"section": "fla", "fla": name, "kernel": kind, "B": B, "T": T, "Hv": Hv, "error": repr(e)[:300]})
            continue
        record({"section": "fla", "fla": name, "kernel": kind, "B": B, "T": T, "Hv": Hv, "us": us, "err": err,
                "state_err": serr, "split_us": split})


def table():
    print("\n| kernel | B | T | Hv | Pallas us | XLA ref us | FLA us (which) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    flas = {}
    for r in ROWS:
        if r["section"] == "fla" and "us" in r and "kernel" in r:
            kind = "verify" if r["kernel"] == "verify" else r["kernel"]
            flas.setdefault((kind, r["B"], r["T"], r["Hv"]), []).append(f"{r['us']:.1f} ({r['fla']})")
    for r in ROWS:
        if r["section"] == "time" and "pallas_us" in r:
            f = ", ".join(flas.get((r["kernel"], r["B"], r["T"], r["Hv"]), [])) or "-"
            name = r["kernel"] + (f" ({r['form']})" if "form" in r else "")
            print(f"| {name} | {r['B']} | {r['T']} | {r['Hv']} | {r['pallas_us']:.1f} | {r['xla_ref_us']:.1f} "
                  f"| {f} |")
    errs = [r for r in ROWS if r["section"] == "check" and "err" in r]
    if errs:
        worst = max(max(r.get("err", 0) if r.get("err") == r.get("err") else 0, r.get("state_err", 0)) for r in errs)
        bad = [r for r in errs if not (r.get("err", 0) <= 1e-4 or r.get("err") != r.get("err")) or
               not r.get("state_err", 0) <= 1e-4]
        print(f"\nchecks: {len(errs)}, worst relative error {worst:.3g}, over 1e-4: {len(bad)}")


def gated_delta_main(argv):
    """`gated_delta` (the module docstring)."""
    global ARGS, ENV, START
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch (FLA) shares the GPU
    START = time.time()
    p = argparse.ArgumentParser(prog="qwen35.py gated_delta")
    p.add_argument("--sections", default="sweep,check,time,fla")
    p.add_argument("--fla", default="", help="a directory holding the fla package")
    p.add_argument("--budget", type=float, default=400.0, help="seconds; sections stop early past it")
    p.add_argument("--reps", type=int, default=1, help="FLA profiles a case")
    p.add_argument("--tol", type=float, default=2e-5, help="the sweep's largest error for a variant to be picked")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU run of the script, interpret mode)")
    p.add_argument("--kernels", default="verify,decode,replay,prefill",
                   help="the entry points the sections run (comma-separated)")
    p.add_argument("--forms", default=",".join(PREFILL_FORMS),
                   help=f"the prefill forms the check and time sections run, of {','.join(PREFILL_FORMS)} "
                        "(the sweep: the variants of their prefill_form)")
    ARGS = p.parse_args(argv)
    KINDS[:] = ARGS.kernels.split(",")
    if ARGS.smoke:
        global Hk, Dk, Dv
        Hk, Dk, Dv = 2, 16, 16
    ENV = env_info()
    print(ENV, flush=True)
    for name in ARGS.sections.split(","):
        t = time.time()
        try:
            {"check": kernel_check, "time": timing, "sweep": sweep, "fla": fla}[name]()
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            record({"section": name, "error": repr(e)[:500]})
        print(f"[{name}: {time.time() - t:.0f} s]", flush=True)
    table()


# --------------------------------------------------------------------------- main

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gated_delta"]:
        return gated_delta_main(argv[1:])
    if argv[:1] == ["split"]:
        return split_main(argv[1:])
    if argv[:1] == ["fp8"]:
        return fp8_main(argv[1:])
    if argv[:1] in (["prefill"], ["transformers_prefill"]):
        lengths = [int(a) for a in argv[1:] if not a.startswith("--")] or [4096, 32768, 131072]
        if argv[0] == "transformers_prefill":
            return transformers_prefill_bench(QWEN35_27B, "transformers_prefill_qwen35_27b.json", lengths)
        kernel_blocks = "--kernel-blocks" in argv
        tuning = jspec.Tuning(attention=AttentionTiles(fused_prompt_blocks=False)) if kernel_blocks else None
        return prefill_bench(QWEN35_27B, "prefill_qwen35_27b.json", lengths, [tuning], reps={131072: 1})
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES) + ["check"], help="(or gated_delta, with options of its own)")
    ap.add_argument("parts", nargs="*", default=["decode", "mtp", "commit"])
    ap.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    args = ap.parse_args(argv)
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
