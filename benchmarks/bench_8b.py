"""Llama-3.1-8B-shaped benchmarks with random bf16 weights (one GPU).

Decode: ms/token at batch 1 and 32, context 1k, and bandwidth utilisation = (weight
bytes + KV bytes read per step) / step time / device-to-device copy bandwidth.
Chain rounds: time per round for S = 1..5 with an EAGLE-3-shaped head (one layer, 32k
draft vocabulary) as a ratio to one autoregressive step, batch 1.
Tree rounds: (S,K,N) = (5,4,8), (5,8,16), (6,10,60), same ratio.

--tunings a,b,...: every part under each of these `common.TUNINGS` settings, side by side
in one process on the same weights (repeat a name to alternate); rows of a tuning other
than default are keyed `<row>_<tuning>`, and each decode row says whether its tokens
equal the first tuning's.

--round-batches 1,32: the round parts at each of these batch sizes (default 1).

Run: PYTHONPATH=. python3 benchmarks/bench_8b.py [decode|decode1|chain|chain3|tree|tree16|tree60 ...]
     [--tunings default,attn_bk64] [--round-batches 1,32]   (chain3: S=3 only; tree16: (5,8,16) only; decode1: batch 1 only)

sampling: what sampling costs a round. For plain decoding, the EAGLE-3-shaped chain S=3
(target-only and with sampled drafts) and the tree (S,K,N) = (5,8,16), at batch 1 and 32,
one compiled program each, the time per round under several sampling settings, side by
side, as a ratio to the same program's greedy round:
  greedy        temperature 0
  T=0.7         temperature only
  T=0.7 top-p   top_p 0.9, top_k 50, min_p 0.05 (both threshold searches run)
  penalties     T=0.7 with repetition 1.1, presence 0.3, frequency 0.2
Random weights give near-uniform distributions, so the top-p search runs its full length
and nearly every draft is rejected: this measures cost, not acceptance.
     PYTHONPATH=. python3 benchmarks/bench_8b.py sampling [--batches 1 32] [--shapes plain 3,1,4 3,1,4,q 5,8,16]
Result: $OUT/bench_sampling.json

constraint: what a JSON-schema constraint costs a round (`jspec.constraints`): plain
decoding, the EAGLE-3-shaped chain S=3 and the tree (5,8,16) at batch 1 and 32, each
compiled twice, free and with every row under one schema (an array of at least 100
integers, `CONSTRAINT_SCHEMA`: it cannot complete within the run), the time per round
from the difference of two lengths; the tokenizer is the bundled pair's (4,096 tokens of
the 128,256: the masks and tables have the 8B vocabulary's width).
     PYTHONPATH=. python3 benchmarks/bench_8b.py constraint [--batches 1 32] [--shapes plain 3,1,4 5,8,16] [--tiny]
Result: $OUT/bench_constraint.json

fp8: FP8 weights (`jspec.quantization.quantize_params`: every projection but the LM head
rounded to E4M3 in 128 x 128 blocks and kept FP8, scales per 128 rows and column) against
the same random bf16 weights, one process: first each projection shape's product at 1, 32
and 2048 rows (`fp8_products`: bf16, FP8 dequantized in the graph, the FP8 matvec kernel,
FP8 x FP8 per group of 128 (XLA, a dot a group), jspec's FP8 kernel, on Hopper the Mosaic
GPU FP8 kernel up to 16 rows and from 64 rows the Mosaic GPU w8a8 kernel
(`kernels.fp8.w8a8`), torch's bf16 and cuBLASLt FP8
`_scaled_mm`; `--sweep`: the FP8 kernel's tilings, `FP8_SWEEP`), then the decode
step at batch 1 and 32 and the chain S=3 and tree (5,8,16) rounds of the EAGLE-3-shaped
head at batch 1 (ms a round, and as ratios to each precision's own AR step).
--fp8-paths default|mosaic|triton ...: the FP8 rows under each kernel path, side by side on
the same weights (keys fp8 for default, else fp8_<path>): default, the tuning's own rule;
mosaic, `Fp8Tiles.mosaic_rows=16` (the Mosaic GPU kernel up to 16 rows on a Hopper GPU);
triton, mosaic_rows=0 (the Triton kernel only). Every row also says whether its tokens
(a run of 144 new tokens) equal the first FP8 path's, and each round row whether its
greedy speculative tokens equal the same weights' and path's plain decoding at that batch
(`same_tokens_as_plain`: the share of prompts).
--products-only: the products' table alone (no decode).
     PYTHONPATH=. python3 benchmarks/bench_8b.py fp8 [--batches 1 32] [--shapes 3,1,4 5,8,16] [--product-rows 1 32 2048] [--sweep] [--skip-products | --products-only] [--tuning NAME] [--fp8-paths mosaic triton] [--tiny]
Result: $OUT/bench_fp8.json

transformers: transformers' decode step on the same shape, as a peer figure: greedy
`generate` from a 1k prompt with a static cache, which makes transformers compile its
decoding forward itself (`CompileConfig(fullgraph=True, mode="reduce-overhead")`:
torch.compile with CUDA graphs); ms per step = the time difference of two lengths over
their step difference (so the prefill cancels), batch 1 and 32. (Compiling `model.forward`
by hand instead failed in transformers 5.17: CUDA-graph outputs overwritten, then a
segmentation fault.)
     PYTHONPATH=. python3 benchmarks/bench_8b.py transformers [batch ...]
Result: $OUT/transformers_8b.json

prefill: one prompt of 4k, 16k, 32k and 128k tokens through `jspec.compile(...).run` with
max_new_tokens=1 (prefilled in blocks of `Tuning.prefill_block`), every length through ONE
program compiled for `CacheConfig(max_len=...)` (dense; `--paged` adds the paged cache),
seconds a prompt (median of 3 after a warm run), tokens/s and MFU against the bf16 matmul
rate measured in the same process. Then one layer's causal attention over T tokens, in
milliseconds: cuDNN's fused attention (`jax.nn.dot_product_attention(implementation=
"cudnn")`), jspec's prefill path (the first block by the reference, every later block by
the Pallas cache kernel over the prefix) and jax's example Pallas kernels, Triton
(`pallas.ops.gpu.attention`) and Mosaic GPU (`pallas.ops.gpu.attention_mgpu`), where they
run.
     PYTHONPATH=. python3 benchmarks/bench_8b.py prefill [4096 16384 32768 131072] [--paged]
         [--blocks 2048 8192] [--max-len N] [--kernel-blocks]
Result: $OUT/prefill_8b.json
transformers_prefill: transformers' one prefill forward (sdpa, logits of the last position
only) at the same lengths.
     PYTHONPATH=. python3 benchmarks/bench_8b.py transformers_prefill [4096 ...]
Result: $OUT/transformers_prefill_8b.json
dflash: what a DFlash block drafter's round costs: a random drafter of z-lab's shape for
this target (5 Qwen3 layers of the target's width, 32/8 heads, the target's MLP width,
reading the outputs of target layers 1, 8, 15, 22, 29; `benchmarks.common.dflash_drafter`)
at blocks of 16, 8 and 4 (chains of 15, 7 and 3 drafts) and a tree from per-slot top-2
(S=15, N=24), at batch 1 (and --batches), ms a round and as a ratio to the AR step of the
same call, then tokens/s projected at accepted lengths (--taus: the published range for
z-lab's Qwen3-8B drafter, 6.35-8.0, and 4.0).
     PYTHONPATH=. python3 benchmarks/bench_8b.py dflash [--batches 1 8] [--taus 4 6.35 8] [--shapes S,K,N ...]
         [--tunings NAME ...]   (the AR step and each shape's round under each common.TUNINGS name)
Result: $OUT/bench_dflash_8b.json
long: decode and speculation over long caches. Each row's dense cache holds `ctx` random
committed slots (`common.filled_state`; no prefill), and one program per (batch, shape),
sized for the longest context, runs every context (`common.step_times`): the AR step
(ms, and bandwidth utilisation = (weights + KV read) / time / copy ceiling), and the chain
S=3 and tree (5,8,16) rounds of the EAGLE-3-shaped head as ratios to the AR step at the
same context. Batch 1 at 1k, 4k, 32k and 128k; batch 8 at 1k, 4k and 32k (its 128k KV
cache, 137 GB, does not fit one GPU beside the weights).
--fp8-kv: every step and round also over an FP8 cache (`CacheConfig(dtype="float8_e4m3fn")`,
the bandwidth utilisation counting its bytes), side by side; --no-rounds: the AR steps only.
     PYTHONPATH=. python3 benchmarks/bench_8b.py long [--rounds 40] [--fp8-kv] [--no-rounds]
         [--contexts CTX ...] [--batches B ...]
(--contexts: these contexts instead of LONG_CONTEXTS's, each through a program sized for
it alone, as a server compiled for that length would run it; --batches: these batches)
Result: $OUT/long_context_8b.json (with --fp8-kv: $OUT/long_context_8b_kv.json)
"""
from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys
import time

import jspec
from benchmarks.common import (CTX, LLAMA31_8B, LONG, SHORT, Runner, best_call_time, ceiling_of, copy_bandwidth,
                               dflash_drafter, eagle3_head, median_time, prefill_bench, step_times,
                               transformers_prefill_bench,
                               env_info, kv_bytes, prompts, random_params, rounded, save_json, tagged, tunings,
                               tuning_of,
                               weight_bytes)

PARTS = ("decode", "decode1", "chain", "chain3", "tree", "tree16", "tree60")
ROUND_PARTS = {"chain", "chain3", "tree", "tree16", "tree60"}


def round_shapes(parts) -> list[tuple[int, int, int]]:
    shapes = []
    if "chain" in parts:
        shapes += [(s, 1, s + 1) for s in range(1, 6)]
    elif "chain3" in parts:
        shapes += [(3, 1, 4)]
    if "tree" in parts:
        shapes += [(5, 4, 8), (5, 8, 16), (6, 10, 60)]
    else:
        shapes += [(5, 8, 16)] * ("tree16" in parts) + [(6, 10, 60)] * ("tree60" in parts)
    return shapes


# --------------------------------------------------------------------------- sampling

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "T=0.7": dict(temperature=0.7),
    "T=0.7 top-p": dict(temperature=0.7, top_p=0.9, top_k=50, min_p=0.05),
    "penalties": dict(temperature=0.7, repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2),
}
NEUTRAL = dict(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
               frequency_penalty=0.0, seed=0)


def spec_of(shape: str):
    """'plain' -> None; 'S,K,N' -> SpecConfig; a trailing ',q' samples the drafts."""
    if shape == "plain":
        return None
    parts = shape.split(",")
    S, K, N = map(int, parts[:3])
    return jspec.SpecConfig(num_steps=S, topk=K, num_draft_tokens=N, sample_drafts=parts[3:] == ["q"])


def sampling(argv):
    """`sampling` (the module docstring)."""
    ap = argparse.ArgumentParser(prog="bench_8b.py sampling")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 32])
    ap.add_argument("--shapes", nargs="*", default=["plain", "3,1,4", "3,1,4,q", "5,8,16"])
    args = ap.parse_args(argv)
    res = {"env": env_info(), "rows": []}
    print(res["env"], flush=True)
    t0 = time.perf_counter()
    target = random_params(LLAMA31_8B)
    spec_params = target.with_draft(eagle3_head(target))
    print(f"weights ready in {time.perf_counter() - t0:.1f}s", flush=True)
    for batch in args.batches:
        for shape in args.shapes:
            spec = spec_of(shape)
            r = Runner(spec_params if spec else target, prompts(batch), LONG, spec=spec)
            row = {"batch": batch, "shape": shape, "compile_s": r.compile_s}
            for name, values in SETTINGS.items():
                per, rounds, toks = r.per_round(SHORT, LONG, **dict(NEUTRAL, **values))
                row[name] = {"ms_per_round": per * 1e3, "tokens_per_round": toks / max(rounds, 1) / batch}
            g = row["greedy"]["ms_per_round"]
            for name in SETTINGS:
                row[name]["ratio_to_greedy"] = row[name]["ms_per_round"] / g
            res["rows"].append(row)
            print(batch, shape, {k: (round(v["ms_per_round"], 3), round(v["ratio_to_greedy"], 3))
                                 for k, v in row.items() if isinstance(v, dict)}, flush=True)
            save_json("bench_sampling.json", res)
            del r
    print("saved", save_json("bench_sampling.json", res))


CONSTRAINT_SCHEMA = {"type": "array", "items": {"type": "integer"}, "minItems": 100}  # cannot complete in LONG tokens


def round_row(params, batch_prompts, spec, tokens: bool = False, **kw) -> dict:
    """One compiled program's ms a round (the difference of two lengths), tokens a round
    and row, and compile seconds; tokens: also "tokens", each prompt's LONG new tokens."""
    r = Runner(params, batch_prompts, LONG, spec=spec, **kw)
    per, rounds, toks = r.per_round(SHORT, LONG)
    row = {"ms_per_round": per * 1e3, "tokens_per_round": toks / max(rounds, 1) / len(batch_prompts),
           "compile_s": r.compile_s}
    if tokens:
        out = r.run(LONG)[1].tokens
        row["tokens"] = [list(map(int, t)) for t in (out if out and isinstance(out[0], list) else [out])]
    return row


def same_share(a: list, b: list) -> float:
    """The share of prompts whose token lists are equal."""
    return sum(x == y for x, y in zip(a, b)) / max(len(a), 1)


def dflash_cost(argv):
    """`dflash` (the module docstring)."""
    ap = argparse.ArgumentParser(prog="bench_8b.py dflash")
    ap.add_argument("--batches", type=int, nargs="*", default=[1])
    ap.add_argument("--taus", type=float, nargs="*", default=[4.0, 6.35, 8.0])
    ap.add_argument("--shapes", nargs="*", default=["15,1,16", "7,1,8", "3,1,4", "15,2,24"])
    ap.add_argument("--tunings", nargs="*", default=["default"],
                    help="common.TUNINGS names: the AR step and each shape's round under each")
    args = ap.parse_args(argv)
    res = {"env": env_info(), "rows": []}
    print(res["env"], flush=True)
    t0 = time.perf_counter()
    target = random_params(LLAMA31_8B)
    drafter = dflash_drafter(target)
    spec_params = target.with_draft(drafter)
    res["drafter"] = repr(drafter.config)
    print(f"weights ready in {time.perf_counter() - t0:.1f}s", flush=True)
    for batch, name in itertools.product(args.batches, args.tunings):
        tuning = {} if name == "default" else {"tuning": tuning_of(name)}
        ar = round_row(target, prompts(batch), None, **tuning)
        res["rows"].append(dict(ar, batch=batch, shape="plain", tuning=name))
        print(batch, "plain", name, rounded(ar), flush=True)
        for shape in args.shapes:
            row = round_row(spec_params, prompts(batch), spec_of(shape), **tuning)
            row.update(batch=batch, shape=shape, tuning=name, ratio_to_ar_step=row["ms_per_round"] / ar["ms_per_round"],
                       projected_tokens_per_s={str(t): batch * t / row["ms_per_round"] * 1e3 for t in args.taus})
            res["rows"].append(row)
            print(batch, shape, rounded(row), flush=True)
            save_json("bench_dflash_8b.json", res)
    print("saved", save_json("bench_dflash_8b.json", res))


def constraint_cost(argv):
    """`constraint` (the module docstring)."""
    import dataclasses
    from jspec import bundle
    from jspec.constraints import compile_constraint
    from jspec.constraints import tables as gt
    ap = argparse.ArgumentParser(prog="bench_8b.py constraint")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 32])
    ap.add_argument("--shapes", nargs="*", default=["3,1,4", "5,8,16"])
    ap.add_argument("--tiny", action="store_true", help="a 4-layer toy of the shape (a CPU check)")
    args = ap.parse_args(argv)
    res = {"env": env_info(), "schema": CONSTRAINT_SCHEMA, "rows": []}
    print(res["env"], flush=True)
    cfg = LLAMA31_8B if not args.tiny else dataclasses.replace(
        LLAMA31_8B, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
        sliding_windows=(0,) * 4)
    tokenizer = bundle.load(None, dtype="float32").tokenizer
    target = dataclasses.replace(random_params(cfg), tokenizer=tokenizer)
    spec_params = target.with_draft(eagle3_head(target, draft_vocab=4096 if args.tiny else 32000))
    constraint = jspec.JsonSchema(CONSTRAINT_SCHEMA)
    automaton = compile_constraint(constraint, tokenizer, cfg.vocab_size)
    res["automaton"] = {"states": automaton.num_states, "transitions": automaton.edges(),
                        "exceptions": gt.needs(automaton)[1], "tables": gt.capacity([automaton])}
    print(res["automaton"], flush=True)
    vocab = min(cfg.vocab_size, 4096)
    for batch in args.batches:
        for shape in args.shapes:
            spec = spec_of(shape)
            row = {"batch": batch, "shape": shape}
            for name, kw in (("free", {}), ("json", {"constraint": constraint})):
                row[name] = round_row(spec_params if spec else target, prompts(batch, vocab), spec, **kw)
            row["ratio"] = row["json"]["ms_per_round"] / row["free"]["ms_per_round"]
            res["rows"].append(row)
            print(batch, shape, {k: (round(v["ms_per_round"], 3), round(v["tokens_per_round"], 2))
                                 for k, v in row.items() if isinstance(v, dict)}, "ratio", round(row["ratio"], 3),
                  flush=True)
            save_json("bench_constraint.json", res)
    print("saved", save_json("bench_constraint.json", res))


# --------------------------------------------------------------------------- FP8 weights

FP8_PRODUCTS = {"qkv_proj": (4096, 6144), "o_proj": (4096, 4096), "gate_up_proj": (4096, 28672),
                "down_proj": (14336, 4096)}


FP8_SWEEP = ([(bn, w, st, 528, True) for bn in (64, 128, 256) for w, st in ((4, 3), (4, 5), (8, 4))]
             + [(128, 4, 3, 264, True), (128, 4, 3, 1056, True), (128, 4, 3, 528, False)])  # (block_n, warps, stages, programs, evict_first)


def fp8_products(rows_list, copies: int = 6, tiny: bool = False, sweep: bool = False,
                 diagnose: bool = False) -> list[dict]:
    """Each 8B projection shape at each row count: ms a product of bf16 (XLA's dot, as the
    model runs it), FP8 dequantized in the graph then XLA's dot, the FP8 matvec kernel (one
    row), FP8 x FP8 on the tensor cores (activations rounded to E4M3 per row and group of
    128, one XLA dot a group, scales applied to the float32 partial sums), and torch's
    bf16 `mm` and cuBLASLt's FP8 `_scaled_mm` (row-wise scales) as peers. Each timed call
    runs `copies` distinct weights, so no weight is read from L2; calls are issued back to
    back, best of 3 (`common.best_call_time`: the host's dispatch overlaps the device)."""
    import jax
    import jax.numpy as jnp
    from jspec.kernels.fp8 import matmul as fp8_matmul, mosaic as fp8_mosaic, w8a8 as fp8_w8a8
    from jspec.kernels.moe import experts
    from jspec.models.layers import product
    from jspec.quantization import GROUP, dequantize_kernel, quantize_kernel

    def w8a8(x, q, scale):
        M, K = x.shape
        G = K // GROUP
        x8, sx = fp8_w8a8.quantize_rows(x)  # [M, K] E4M3, [M, G]
        xq = x8.reshape(M, G, GROUP)
        part = jax.lax.dot_general(xq, q.reshape(G, GROUP, -1), (((2,), (1,)), ((1,), (0,))),
                                   preferred_element_type=jnp.float32)  # [G, M, N]
        return jnp.einsum("gmn,mg,gn->mn", part, sx, scale).astype(x.dtype)

    variants = {
        "bf16": lambda x, w, q, s: product(x, w),
        "fp8_dequant": lambda x, w, q, s: product(x, dequantize_kernel(q, s, x.dtype)),
        "fp8_matvec": lambda x, w, q, s: experts.matvec(x, q, w_scale=s),
        "bf16_matvec": lambda x, w, q, s: experts.matvec(x, w),  # the same kernel reading bf16
        "fp8_w8a8": lambda x, w, q, s: w8a8(x, q, s),
        "fp8_kernel": lambda x, w, q, s: fp8_matmul.fp8_matmul(x, q, s),
    }
    if fp8_mosaic.on_hopper():  # the Mosaic GPU kernels (up to 16 rows; w8a8 from 64)
        variants["fp8_mosaic"] = lambda x, w, q, s: fp8_mosaic.fp8_matmul_mosaic(x, q, s)
        variants["fp8_w8a8_mosaic"] = lambda x, w, q, s: fp8_w8a8.fp8_w8a8_mosaic(x, q, s)
    def by_groups(x, q, scale):  # one dot a group of the weight widened only, scales on the partial sums
        M, K = x.shape
        G = K // GROUP
        part = jnp.einsum("mgk,gkn->gmn", x.reshape(M, G, GROUP), q.reshape(G, GROUP, -1).astype(x.dtype),
                          preferred_element_type=jnp.float32)
        return jnp.einsum("gmn,gn->mn", part, scale).astype(x.dtype)

    any_triton = {"xla_gpu_triton_gemm_any": True}
    options = {}
    if diagnose:  # where the FP8 products' time goes
        variants = {k: variants[k] for k in ("bf16", "bf16_matvec", "fp8_matvec", "fp8_kernel", "fp8_dequant")}
        variants["fp8_dequant_tga"] = variants["fp8_dequant"]
        variants["fp8_column_scale"] = lambda x, w, q, s: (product(x, q.astype(x.dtype), float32_out=True)
                                                           * s[0]).astype(x.dtype)  # timing only
        variants["fp8_column_scale_tga"] = variants["fp8_column_scale"]
        variants["fp8_groups"] = lambda x, w, q, s: by_groups(x, q, s)
        variants["fp8_groups_tga"] = variants["fp8_groups"]
        options = {k: any_triton for k in variants if k.endswith("_tga")}
    if sweep:  # bf16 against the kernel's tilings
        variants = {k: variants[k] for k in ("bf16", "fp8_matvec", "bf16_matvec")}
        for bn, warps, stages, programs, evict in FP8_SWEEP:
            tiles = fp8_matmul.Fp8Tiles(block_n=bn, num_warps=warps, num_stages=stages, target_programs=programs,
                                        evict_first=evict)
            variants[f"fp8_kernel_{bn}_{warps}_{stages}_{programs}_{int(evict)}"] = functools.partial(
                lambda x, w, q, s, tiles: fp8_matmul.fp8_matmul(x, q, s, tiles=tiles), tiles=tiles)
    rows_out = []
    key = jax.random.key(0)
    for name, (K, N) in FP8_PRODUCTS.items():
        if tiny:
            K, N = K // 16, N // 16
        ws = [jax.random.normal(jax.random.fold_in(key, i), (K, N), jnp.bfloat16) * 0.02 for i in range(copies)]
        qs = [jax.jit(quantize_kernel)(w) for w in ws]
        for rows in rows_list:
            x = jax.random.normal(jax.random.fold_in(key, 99), (rows, K), jnp.bfloat16)
            row = {"product": name, "K": K, "N": N, "rows": rows}
            ref = None
            for vname, fn in variants.items():
                if (vname in ("fp8_matvec", "bf16_matvec") and rows != 1 or vname.startswith("fp8_groups") and rows > 4
                        or vname == "fp8_mosaic" and rows > fp8_mosaic.MAX_ROWS
                        or vname == "fp8_w8a8_mosaic" and rows < 64):
                    continue
                def many(x, ws, qs, fn=fn):  # the products of `copies` weights, nothing added
                    return tuple(fn(x, w, q, s) for w, (q, s) in zip(ws, qs))
                try:
                    f = jax.jit(many)
                    if vname in options and jax.default_backend() == "gpu":
                        f = f.lower(x, ws, qs).compile(compiler_options=options[vname])
                    t, outs = best_call_time(f, x, ws, qs, calls=20)
                    out = sum(o.astype(jnp.float32) for o in outs)
                    t /= copies
                except Exception as e:  # noqa: BLE001
                    row[vname] = repr(e)[:300]
                    continue
                row[vname + "_ms"] = t * 1e3
                if ref is None:
                    ref = out
                else:
                    row[vname + "_rel_err"] = float(jnp.abs(out - ref).max() / jnp.abs(ref).max())
            row.update(torch_products(rows, K, N, copies))
            for vname in ["fp8_dequant", "fp8_matvec", "fp8_w8a8", "fp8_w8a8_mosaic", "fp8_kernel", "fp8_mosaic",
                          "torch_scaled_mm", "bf16_matvec",
                          "fp8_dequant_tga", "fp8_column_scale", "fp8_column_scale_tga", "fp8_groups",
                          "fp8_groups_tga"] + [
                    k[:-3] for k in row if k.startswith("fp8_kernel_") and k.endswith("_ms")]:
                if vname + "_ms" in row and "bf16_ms" in row:
                    row[vname + "_speedup"] = row["bf16_ms"] / row[vname + "_ms"]
            rows_out.append(row)
            print("product", rounded(row), flush=True)
    return rows_out


def best_fp8_tuning(products: list[dict]):
    """The Tuning whose FP8 tiles took the least time summed over the products at 1 and 32
    rows (of the swept tilings)."""
    from jspec.kernels.fp8.matmul import Fp8Tiles
    from jspec.tuning import Tuning
    totals = {}
    for row in products:
        if row["rows"] in (1, 32):
            for k, v in row.items():
                if k.startswith("fp8_kernel_") and k.endswith("_ms"):
                    totals[k] = totals.get(k, 0.0) + v
    bn, warps, stages, programs, evict = map(int, min(totals, key=totals.get)[len("fp8_kernel_"):-3].split("_"))
    return Tuning(fp8=Fp8Tiles(block_n=bn, num_warps=warps, num_stages=stages, target_programs=programs,
                               evict_first=bool(evict)))


def torch_products(rows: int, K: int, N: int, copies: int) -> dict:
    """torch's bf16 `mm` and `_scaled_mm` (FP8, row-wise scales; rows padded to 16) on the
    same shape, ms a product (CUDA events over `copies` weights, median of 10)."""
    try:
        import torch
        if not torch.cuda.is_available():
            return {}
    except ImportError:
        return {}
    dev = "cuda"
    x = torch.randn(max(rows, 16), K, device=dev, dtype=torch.bfloat16)
    ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    xq = x.to(torch.float8_e4m3fn)
    wq = [w.to(torch.float8_e4m3fn) for w in ws]
    sa = torch.ones(x.shape[0], 1, device=dev, dtype=torch.float32)
    sb = torch.ones(1, N, device=dev, dtype=torch.float32)
    out = {}

    def timed(fn):
        for _ in range(3):
            fn()
        times = []
        for _ in range(10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / copies)
        return sorted(times)[len(times) // 2]
    xr = x[:rows]
    out["torch_bf16_ms"] = timed(lambda: [xr @ w.t() for w in ws])
    try:
        out["torch_scaled_mm_ms"] = timed(lambda: [torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=sb,
                                                                    out_dtype=torch.bfloat16) for w in wq])
    except Exception as e:  # noqa: BLE001
        out["torch_scaled_mm"] = repr(e)[:300]
    return out


def fp8_cost(argv):
    """`fp8` (the module docstring)."""
    import dataclasses
    from jspec.quantization import quantize_params
    ap = argparse.ArgumentParser(prog="bench_8b.py fp8")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 32])
    ap.add_argument("--shapes", nargs="*", default=["3,1,4", "5,8,16"])
    ap.add_argument("--product-rows", type=int, nargs="*", default=[1, 32, 2048])
    ap.add_argument("--skip-products", action="store_true")
    ap.add_argument("--products-only", action="store_true")
    ap.add_argument("--tuning", default=None, help="the decode rows under this `common.TUNINGS` name (both "
                                                    "sides; without --sweep)")
    ap.add_argument("--diagnose", action="store_true", help="products: where FP8's time goes (the matvec kernel "
                                                            "on bf16, XLA's Triton GEMMs on widened weights)")
    ap.add_argument("--sweep", action="store_true", help="products: bf16 against the FP8 kernel's tilings "
                                                         "(FP8_SWEEP); the decode then takes the best at 1 and 32 rows")
    ap.add_argument("--fp8-paths", nargs="*", default=["default"], choices=["default", "mosaic", "triton"],
                    help="the FP8 rows under each kernel path (default: the tuning's rule; mosaic: "
                         "Fp8Tiles.mosaic_rows=16; triton: mosaic_rows=0), side by side")
    ap.add_argument("--tiny", action="store_true", help="a 4-layer toy of the shape (a CPU check)")
    args = ap.parse_args(argv)
    res = {"env": env_info(), "rows": [], "fp8_paths": args.fp8_paths}
    print(res["env"], flush=True)
    tuning = None if args.tuning is None else tuning_of(args.tuning)
    if not args.skip_products:
        res["products"] = fp8_products(args.product_rows, tiny=args.tiny, sweep=args.sweep, diagnose=args.diagnose)
        save_json("bench_fp8.json", res)
        if args.sweep:
            tuning = best_fp8_tuning(res["products"])
            res["tuning"] = str(tuning.fp8)
            print("decode with", tuning.fp8, flush=True)
    if args.products_only:
        return
    cfg = LLAMA31_8B if not args.tiny else dataclasses.replace(
        LLAMA31_8B, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
        sliding_windows=(0,) * 4)
    t0 = time.perf_counter()
    float_target = random_params(cfg)
    fp8_target = quantize_params(float_target)
    res["weight_bytes"] = {"bf16": weight_bytes(float_target), "fp8": weight_bytes(fp8_target),
                           "fp8_of_them": fp8_target.weight_bytes()[1]}
    print(f"weights ready in {time.perf_counter() - t0:.1f}s", res["weight_bytes"], flush=True)
    head = eagle3_head(float_target, draft_vocab=4096 if args.tiny else 32000)
    vocab = min(cfg.vocab_size, 4096) if args.tiny else 100000
    base = tuning or jspec.Tuning()
    paths = {"default": tuning, "mosaic": base.replace(fp8=dataclasses.replace(base.fp8, mosaic_rows=16)),
             "triton": base.replace(fp8=dataclasses.replace(base.fp8, mosaic_rows=0))}
    runs = [("bf16", float_target, tuning)] + [("fp8" if p == "default" else f"fp8_{p}", fp8_target, paths[p])
                                               for p in args.fp8_paths]
    first_fp8 = runs[1][0]
    plain_tokens = {}  # (key, batch) -> tokens
    for batch, shape in [(b, "plain") for b in args.batches] + [(1, shape) for shape in args.shapes]:
        spec = spec_of(shape)
        row = {"batch": batch, "shape": shape}
        for name, target, tuned in runs:
            row[name] = round_row(target.with_draft(head) if spec else target, prompts(batch, vocab), spec,
                                  tokens=True, tuning=tuned)
            toks = row[name].pop("tokens")
            if spec is None:
                plain_tokens[name, batch] = toks
            elif (name, batch) in plain_tokens:
                row[name]["same_tokens_as_plain"] = same_share(toks, plain_tokens[name, batch])
            if name.startswith("fp8"):
                row[name]["tokens_of_run"] = toks
        for name, _, _ in runs[1:]:
            row[f"{name}_speedup"] = row["bf16"]["ms_per_round"] / row[name]["ms_per_round"]
            row[name]["same_tokens_as_" + first_fp8] = same_share(row[name]["tokens_of_run"],
                                                                  row[first_fp8]["tokens_of_run"])
        for name, _, _ in runs[1:]:
            row[name].pop("tokens_of_run")
        res["rows"].append(row)
        print(batch, shape, {k: round(v["ms_per_round"], 3) for k, v in row.items() if isinstance(v, dict)},
              "fp8 speed-up", {k: round(v, 3) for k, v in row.items() if k.endswith("_speedup")},
              "same tokens", {k: {t: v[t] for t in v if t.startswith("same_tokens")} for k, v in row.items()
                              if isinstance(v, dict)}, flush=True)
        save_json("bench_fp8.json", res)
    plain = {r["batch"]: r for r in res["rows"] if r["shape"] == "plain"}
    for r in res["rows"]:
        if r["shape"] != "plain" and r["batch"] in plain:
            for name, _, _ in runs:
                r[name]["ratio_to_ar_step"] = r[name]["ms_per_round"] / plain[r["batch"]][name]["ms_per_round"]
    print("saved", save_json("bench_fp8.json", res))


# --------------------------------------------------------------------------- transformers

def transformers_decode(batches):
    """`transformers` (the module docstring)."""
    import torch
    import transformers
    res = {"env": env_info(), "torch": torch.__version__, "transformers": transformers.__version__, "rows": {}}
    print(res, flush=True)
    cfg = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, rms_norm_eps=1e-5, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).eval()
    print(f"weights ready in {time.perf_counter() - t0:.1f}s", flush=True)
    model.generation_config.cache_implementation = "static"
    model.generation_config.compile_config = transformers.CompileConfig(fullgraph=True, mode="reduce-overhead")
    for batch in batches:
        ids = torch.tensor(prompts(batch), device="cuda")

        def run(n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            assert out.shape[1] == CTX + n, out.shape
            return time.perf_counter() - t

        t0 = time.perf_counter()
        run(SHORT), run(LONG)  # compiles
        compile_s = time.perf_counter() - t0
        per = min((run(LONG) - run(SHORT)) / (LONG - SHORT) for _ in range(3))
        row = {"batch": batch, "ms_per_step": per * 1e3, "tokens_per_s": batch / per, "warmup_s": compile_s,
               "compiled": hasattr(model, "_compiled_call")}
        res["rows"][f"b{batch}"] = row
        print("transformers decode", row, flush=True)
        save_json("transformers_8b.json", res)
    return res


# --------------------------------------------------------------------------- prefill

PREFILL_LENGTHS = (4096, 16384, 32768, 131072)


def attention_times(T: int, block: int = 2048) -> dict:
    """ms of one layer's causal attention over T tokens of the 8B shape (see the module)."""
    import jax
    import jax.numpy as jnp
    from jspec.cache.layout import causal_mask
    from jspec.kernels.attention import decode as da
    from jspec.kernels.attention import fused
    from jspec.kernels.meta import AttnMeta
    H, Hkv, Dh = LLAMA31_8B.num_heads, LLAMA31_8B.num_kv_heads, LLAMA31_8B.head_dim
    ks = jax.random.split(jax.random.key(T), 3)
    q = jax.random.normal(ks[0], (1, T, H, Dh), jnp.bfloat16)
    k = jax.random.normal(ks[1], (1, T, Hkv, Dh), jnp.bfloat16)
    v = jax.random.normal(ks[2], (1, T, Hkv, Dh), jnp.bfloat16)
    scale = Dh ** -0.5
    out = {}

    def timed(name, f, *args):
        try:
            out[name] = median_time(jax.jit(f), *args, n=5) * 1e3
        except Exception as e:  # noqa: BLE001 - a peer that does not run is a figure too
            out[name] = f"failed: {type(e).__name__}: {str(e)[:300]}"
        print(f"attention T={T}", name, out[name], flush=True)

    timed("cudnn", lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                implementation="cudnn"), q, k, v)

    def jspec_path(q, k, v, fused_blocks: bool):
        kv = jnp.stack([k, v], axis=2)  # the dense cache [1, T, 2, Hkv, Dh], every key written
        outs = []
        for start in range(0, T, block):
            pos = jnp.arange(start, start + block, dtype=jnp.int32)[None]
            meta = AttnMeta(positions=pos, prefix_len=jnp.full((1,), start, jnp.int32),
                            local_mask=causal_mask(jnp.full((1,), block, jnp.int32), block), local_positions=pos,
                            write_index=pos, page_table=None, prefill=start == 0, causal_block=True)
            qb, kb, vb = q[:, start:start + block], k[:, start:start + block], v[:, start:start + block]
            if fused_blocks:
                outs.append(fused.block_attention(qb, kb, vb, None if start == 0 else kv, meta, scale=scale))
            elif start == 0:
                outs.append(da.attention_reference(qb, kb, vb, None, meta, scale=scale))
            else:
                outs.append(da.paged_decode_attention(qb, kv, meta, scale=scale))
        return jnp.concatenate(outs, axis=1)
    timed("jspec_kernel_blocks", lambda q, k, v: jspec_path(q, k, v, False), q, k, v)
    timed("jspec_fused_blocks", lambda q, k, v: jspec_path(q, k, v, True), q, k, v)
    a, b = (jax.jit(lambda q, k, v, f=f: jspec_path(q, k, v, f))(q, k, v).astype(jnp.float32) for f in (False, True))
    c = jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=scale, implementation="cudnn").astype(jnp.float32)
    out["max_abs_diff_fused_vs_kernel"] = float(jnp.max(jnp.abs(a - b)))
    out["max_abs_diff_fused_vs_one_cudnn_call"] = float(jnp.max(jnp.abs(c - b)))
    print(f"attention T={T}", {k: v for k, v in out.items() if k.startswith("max")}, flush=True)
    try:
        from jax.experimental.pallas.ops.gpu import attention as triton_attention
        kr, vr = (jnp.repeat(x, H // Hkv, axis=2) for x in (k, v))
        timed("pallas_triton", lambda q, k, v: triton_attention.mha(q, k, v, None, sm_scale=scale, causal=True),
              q, kr, vr)
    except Exception as e:  # noqa: BLE001
        out["pallas_triton"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu
        cfg = attention_mgpu.TuningConfig(block_q=128, block_kv=128, max_concurrent_steps=2, causal=True)
        timed("pallas_mosaic_gpu", lambda q, k, v: attention_mgpu.attention(q, k, v, cfg), q, k, v)
    except Exception as e:  # noqa: BLE001
        out["pallas_mosaic_gpu"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
    return out


def prefill_jspec(lengths, paged: bool, kernel_blocks: bool = False, blocks=(), max_len: int | None = None):
    """`prefill` (the module docstring); kernel_blocks: also with the Pallas cache kernel
    instead of cuDNN for the prompt blocks (`AttentionTiles(fused_prompt_blocks=False)`);
    blocks: also each of these `Tuning.prefill_block`s; max_len: every program's cache
    length (default the longest prompt + 64)."""
    from jspec.kernels.attention.decode import AttentionTiles
    default = jspec.Tuning().prefill_block
    tunings = ([None] + [jspec.Tuning(attention=AttentionTiles(fused_prompt_blocks=False))] * kernel_blocks
               + [jspec.Tuning(prefill_block=b) for b in blocks if b != default])
    res = prefill_bench(LLAMA31_8B, "prefill_8b.json", lengths, tunings, settings=("dense", "paged")[:1 + paged],
                        max_len=max_len)
    for T in lengths[:3]:
        res[f"attention_{T}"] = attention_times(T)
        save_json("prefill_8b.json", res)
    return res


# --------------------------------------------------------------------------- long

LONG_CONTEXTS = {1: (1024, 4096, 32768, 131072), 8: (1024, 4096, 32768)}


def long_context(rounds: int = 40, kv_dtypes=(None,), spec_rounds: bool = True, contexts=None, batches=None):
    """`long` (the module docstring). contexts: each measured through a program sized for
    it alone (default: LONG_CONTEXTS, a batch's contexts through one program sized for its
    longest); batches: these batch sizes (default LONG_CONTEXTS's)."""
    res = {"env": env_info(), "rounds": rounds}
    bw = copy_bandwidth()
    ceiling = ceiling_of(bw)
    res["copy_bandwidth"] = bw
    target = random_params(LLAMA31_8B)
    wb = weight_bytes(target)
    spec_params = target.with_draft(eagle3_head(target))
    name = "long_context_8b.json" if kv_dtypes == (None,) else "long_context_8b_kv.json"
    runs = [(b, c) for b, c in LONG_CONTEXTS.items() if batches is None or b in batches] if contexts is None \
        else [(b, (ctx,)) for b in (batches or (1,)) for ctx in contexts]
    for batch, ctxs in runs:
        ar = {}
        for kv in kv_dtypes:  # the model's cache, then an FP8 one: side by side
            ar[kv] = step_times(target, batch, ctxs, rounds, kv_dtype=kv)
            item = 1 if kv else 2  # bytes a key or value element (bf16, or FP8)
            for ctx in ctxs:
                read = wb + kv_bytes(LLAMA31_8B, batch, ctx) * item / 2
                res[f"decode_b{batch}_ctx{ctx}" + (f"_{kv}" if kv else "")] = row = {
                    "batch": batch, "ctx": ctx, "kv_dtype": kv or "model", "ms_per_step": ar[kv][ctx] * 1e3,
                    "GB_read": read / 1e9, "bandwidth_util": read / ar[kv][ctx] / ceiling,
                    **({"speedup_over_model_cache": ar[None][ctx] / ar[kv][ctx]} if kv and None in ar else {})}
                print("decode", rounded(row), flush=True)
            save_json(name, res)
        for S, K, N in ((3, 1, 4), (5, 8, 16)) if spec_rounds else ():
            spec = jspec.SpecConfig(num_steps=S, topk=K, num_draft_tokens=N)
            for kv in kv_dtypes:
                per = step_times(spec_params, batch, ctxs, rounds, spec, kv_dtype=kv)
                for ctx in ctxs:
                    res[f"round_S{S}_K{K}_N{N}_b{batch}_ctx{ctx}" + (f"_{kv}" if kv else "")] = row = {
                        "S": S, "K": K, "N": N, "batch": batch, "ctx": ctx, "kv_dtype": kv or "model",
                        "ms_per_round": per[ctx] * 1e3, "ratio_to_ar_step": per[ctx] / ar[kv][ctx]}
                    print("round", rounded(row), flush=True)
            save_json(name, res)
    return res


# --------------------------------------------------------------------------- main

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sampling"]:
        return sampling(argv[1:])
    if argv[:1] == ["constraint"]:
        return constraint_cost(argv[1:])
    if argv[:1] == ["fp8"]:
        return fp8_cost(argv[1:])
    if argv[:1] == ["dflash"]:
        return dflash_cost(argv[1:])
    if argv[:1] == ["transformers"]:
        return transformers_decode([int(b) for b in argv[1:]] or [1, 32])
    if argv[:1] == ["prefill"]:
        ap = argparse.ArgumentParser(prog="bench_8b.py prefill")
        ap.add_argument("lengths", type=int, nargs="*", default=list(PREFILL_LENGTHS))
        ap.add_argument("--paged", action="store_true", help="also the paged cache")
        ap.add_argument("--kernel-blocks", action="store_true", help="also the Pallas cache kernel for prompt blocks")
        ap.add_argument("--blocks", type=int, nargs="*", default=[], help="also these Tuning.prefill_block sizes")
        ap.add_argument("--max-len", type=int, default=None, help="the cache length (default: longest prompt + 64)")
        args = ap.parse_args(argv[1:])
        return prefill_jspec(args.lengths, args.paged, args.kernel_blocks, args.blocks, args.max_len)
    if argv[:1] == ["long"]:
        ap = argparse.ArgumentParser(prog="bench_8b.py long")
        ap.add_argument("--rounds", type=int, default=40)
        ap.add_argument("--fp8-kv", action="store_true",
                        help="also an FP8 cache (`CacheConfig(dtype=\"float8_e4m3fn\")`), side by side with the model's")
        ap.add_argument("--no-rounds", action="store_true", help="the AR steps only (no chain or tree rounds)")
        ap.add_argument("--contexts", type=int, nargs="+", default=None,
                        help="these contexts, each through a program sized for it alone")
        ap.add_argument("--batches", type=int, nargs="+", default=None, help="these batch sizes")
        args = ap.parse_args(argv[1:])
        return long_context(args.rounds, (None, "float8_e4m3fn") if args.fp8_kv else (None,), not args.no_rounds,
                            args.contexts, args.batches)
    if argv[:1] == ["transformers_prefill"]:
        return transformers_prefill_bench(LLAMA31_8B, "transformers_prefill_8b.json",
                                          [int(a) for a in argv[1:]] or list(PREFILL_LENGTHS))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("parts", nargs="*", help=f"of {', '.join(PARTS)}, or sampling, transformers "
                                             "(default: decode chain tree)")
    ap.add_argument("--tunings", default="default", help="comma-separated common.TUNINGS names")
    ap.add_argument("--round-batches", default="1", help="batch sizes of the round parts (each also decoded)")
    args = ap.parse_args(argv)
    parts = set(args.parts) or {"decode", "chain", "tree"}
    if parts - set(PARTS):
        ap.error(f"unknown parts {sorted(parts - set(PARTS))}; parts: {', '.join(PARTS)}")
    tag = os.environ.get("JSPEC_BENCH_TAG", "")
    name = f"bench_8b{'_' + tag if tag else ''}.json"
    res = {"env": env_info(), "kernels": os.environ.get("JSPEC_KERNELS", "auto"), "tunings": args.tunings}
    print(res["env"], flush=True)
    bw = copy_bandwidth()
    res["copy_bandwidth"] = bw
    ceiling = ceiling_of(bw)
    print("copy bandwidth TB/s", {k: round(v / 1e12, 3) for k, v in bw.items() if isinstance(v, float)}, flush=True)
    t0 = time.perf_counter()
    target = random_params(LLAMA31_8B)
    wb = weight_bytes(target)
    res["weight_bytes"] = wb
    print(f"weights ready in {time.perf_counter() - t0:.1f}s; {wb / 1e9:.2f} GB read per step", flush=True)
    spec_params = target.with_draft(eagle3_head(target)) if parts & ROUND_PARTS else None
    round_batches = tuple(int(b) for b in args.round_batches.split(","))
    batches = (1,) if "decode1" in parts or not parts & {"decode"} else (1, 32)
    batches = tuple(sorted(set(batches) | set(round_batches)))
    seen, first_tokens = {}, {}
    for tname, tuning in tunings(args.tunings):
        ar_step = {}
        for batch in batches:
            r = Runner(target, prompts(batch), LONG, tuning=tuning)
            per, _, _ = r.per_round(SHORT, LONG)
            tokens = r.run(SHORT)[1].tokens
            first_tokens.setdefault(batch, tokens)
            ctx = CTX + (SHORT + LONG) / 2
            ar_step[batch] = per
            read = wb + kv_bytes(LLAMA31_8B, batch, ctx)
            row = {"batch": batch, "tuning": tname, "ms_per_step": per * 1e3, "ms_per_token": per * 1e3 / batch,
                   "tokens_per_s": batch / per, "bandwidth_util": read / per / ceiling,
                   "compile_s": r.compile_s, "same_tokens_as_first_tuning": tokens == first_tokens[batch]}
            res[tagged(f"decode_b{batch}", tname, seen)] = row
            print("decode", rounded(row), flush=True)
            save_json(name, res)
            del r
        for (S, K, N), rb in [(shape, rb) for rb in round_batches for shape in round_shapes(parts)]:
            try:
                spec = jspec.SpecConfig(num_steps=S, topk=K, num_draft_tokens=N)
                r = Runner(spec_params, prompts(rb), LONG, spec=spec, tuning=tuning)
                per, rounds, toks = r.per_round(SHORT, LONG)
                row = {"S": S, "K": K, "N": N, "batch": rb, "tuning": tname, "ms_per_round": per * 1e3,
                       "ratio_to_ar_step": per / ar_step[rb], "compile_s": r.compile_s}
                res[tagged(f"round_S{S}_K{K}_N{N}" + (f"_b{rb}" if rb != 1 else ""), tname, seen)] = row
                print("round", rounded(row), flush=True)
                save_json(name, res)
                del r
            except Exception as e:  # noqa: BLE001
                print("round", (S, K, N), tname, "failed:", repr(e)[:500], flush=True)
    print("saved", save_json(name, res))


if __name__ == "__main__":
    main()
