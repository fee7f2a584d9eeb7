"""DeepSeek benchmarks with random bf16 weights (one GPU): MLA + MoE decoding, MTP rounds,
the V3 layer shape, and settings compared side by side.

Parts (arguments; default: decode mtp v3layer):
- decode: the DeepSeek-V2-Lite shape (27 layers, 15.7B parameters), context 1k, ms/token
  at each of --batches, and bandwidth utilisation = bytes a step must read / step time /
  copy bandwidth. Bytes: every weight but the embedding table and the routed experts,
  plus the routed experts the batch's tokens were sent to (their expected number of
  distinct experts under uniform routing, which random weights give:
  E * (1 - (1 - k/E)^B) per MoE layer), plus the latent cache.
- mtp: a random MTP layer of the same shape as the draft; the --rounds (S x K x N) at
  batch 1 as ratios to one AR step (measured first), with the routed experts a verify of
  N tokens reads (expected distinct experts per MoE layer for N tokens).
- v3layer: the DeepSeek-V3 layer shape (hidden 7168, 128 heads, q_lora 1536, 256 experts,
  top-8, expert width 2048) as models of --v3-layers MoE layers (default 1 and 3, or 1
  and 2 where the GPU holds less than 100 GB: a V3 MoE layer is 22.5 GB of experts); per
  layer: the two models' step difference over their layer difference, at --batch, and its
  bandwidth utilisation (the routed experts: their expected distinct number for the batch).
- ab: V2-Lite with --layers layers at --batch: ms a step from two run lengths'
  difference, a 16-token run's time (median of 5) and what of it is not its steps (inputs,
  prefill, outputs), and whether the tokens equal the first tuning's.

--fp8: decode, mtp and v3layer also run the same weights rounded to FP8 in device memory
(`quantization.quantize_params`: 128 x 128 blocks; the projections and the routed experts,
which the expert kernel reads as FP8), rows suffixed `_fp8`; the bytes a step must read
count the FP8 weights and their scales.

--tunings a,b,...: every part under each of these `common.TUNINGS` settings (`jspec.Tuning`
objects passed to `jspec.compile`), side by side on the same weights; repeat a name to
alternate. Rows of a tuning other than default are keyed `<row>_<tuning>`.

Run: PYTHONPATH=. python3 benchmarks/deepseek.py [decode] [mtp] [v3layer] [ab] [--batches 1,32]
     [--rounds 1x1x2,2x1x3,3x1x4,3x2x4] [--batch 1] [--layers 6] [--v3-layers 1,3] [--fp8]
     [--tunings default,...]
e.g. `deepseek.py ab --layers 27 --tunings graphs_off,default,graphs_off,default`;
     `deepseek.py v3layer --batch 32 --tunings default,few_pairs_ragged`.
Result: $OUT/deepseek.json (JSPEC_BENCH_TAG: deepseek_<tag>.json)

prefill [T ...] [--absorbed] [--fp8] (options of its own; default 4096 32768 65536): one
V2-Lite prompt of each length through one program (`common.prefill_bench`); --absorbed
adds the later prompt blocks in the absorbed form, --fp8 the same rows over the weights
rounded to FP8 (rows `fp8_*`). `transformers_prefill [T ...]`: transformers' forward.
Result: $OUT/prefill_v2_lite.json (JSPEC_BENCH_TAG: prefill_v2_lite_<tag>.json).

dsa (options of its own): DeepSeek-V3.2's sparse attention (DSA) against dense MLA on the
same weights: decode time of the V3.2 layer shape at long contexts, batch 1 and 32. The
caches are filled with random latent rows and indexer keys up to the context instead of
prefilling it (a 64k-token prefill is not what this measures), in a dense layout of
context + 64 slots: a short prompt is admitted, then every row's committed length L is
set to the context, so each decode step attends over (dense) or selects from (DSA) `ctx`
slots. ms a step from `rounds` timed rounds of plain decoding after a warm-up, per layer
count; the per-layer time is the difference over two layer counts. `--mtp` adds, at batch
1 and each context, a random MTP layer of the same shape (with its indexer) and the time
of a chain S=3 and a tree (3,2,4) round as ratios to one plain step of the model with
`--layers`' larger count (random weights: what a round costs, not what it accepts). Every
layer, and the MTP layer's decoder layer, holds layer 0's arrays (`layered`): two V3 MoE
layers and their random initialisation do not fit an H100.

    PYTHONPATH=. python3 benchmarks/deepseek.py dsa [--contexts 4096,16384,65536] [--batches 1,32]
        [--layers 1,2] [--rounds 32] [--mtp] [--shape v32|tiny]
    PYTHONPATH=. python3 benchmarks/deepseek.py dsa --check   # the kernels against their references
    PYTHONPATH=. python3 benchmarks/deepseek.py dsa --topk [--contexts ..] [--topk-rows 1,32,128]
        [--topk-tiles chunk/block/warps/stages,..]   # the top-k selection (topk_bench)
Result: $OUT/dsa_<shape>.json, $OUT/dsa_topk_<shape>.json. Written for the GPU; run on the
CPU with --shape tiny only.

prefill: one V2-Lite prompt of each length (default 4096 32768 65536) through one program
compiled for the longest (`common.prefill_bench`: blocks of `Tuning.prefill_block`, MLA's
prompt blocks in the non-absorbed form through cuDNN), seconds, tokens/s and MFU;
--absorbed also runs them with the later blocks absorbed through the MLA decode kernel
(`MlaDecodeTiles(expanded_prompt_blocks=False)`). transformers_prefill: transformers'
DeepseekV2 of the same shape, one sdpa forward a length (run it in a process of its own).
    PYTHONPATH=. python3 benchmarks/deepseek.py prefill [4096 32768 65536] [--absorbed]
    PYTHONPATH=. python3 benchmarks/deepseek.py transformers_prefill [4096 32768]
Result: $OUT/prefill_v2_lite.json, $OUT/transformers_prefill_v2_lite.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from benchmarks.common import (CTX, V2_LITE, V3_LAYER, V32_LAYER, V32_TINY, Runner, ceiling_of, copy_bandwidth,
                               device_memory, env_info, prefill_bench, prompts, random_params, rounded, save_json,
                               step_time, tagged, transformers_prefill_bench, tunings)
from jspec.drafts import MtpDraft
from jspec.drafts.mtp import layer_config
from jspec.kernels.dsa.index import index_scores, index_scores_reference
from jspec.kernels.mla.decode import MlaDecodeTiles
from jspec.kernels.mla.sparse import sparse_mla_attention, sparse_mla_reference
from jspec.models.deepseek_hf import DeepseekConfig
from jspec.quantization import quantize_params

SHORT, LONG = 16, 112
PARTS = ("decode", "mtp", "v3layer", "ab")


def expert_bytes(params) -> float:
    """Bytes of one routed expert as the target holds it (bf16, or FP8 with its scales)."""
    c, w = params.config, params.weights["params"]
    stack = w[f"layers_{c.first_k_dense_replace}"]["mlp"]["experts"]
    return sum(x.nbytes for x in jax.tree.leaves(stack)) / c.n_routed_experts


def distinct_experts(c: DeepseekConfig, tokens: int) -> float:
    """Expected distinct experts of one MoE layer when `tokens` tokens each pick k of E uniformly."""
    E, k = c.n_routed_experts, c.num_experts_per_tok
    return E * (1 - (1 - k / E) ** tokens)


def fixed_bytes(params) -> int:
    """Weights every step reads: all but the embedding table and the routed experts."""
    w = params.weights["params"]
    total = sum(x.nbytes for x in jax.tree.leaves(w)) - w["embed_tokens"]["embedding"].nbytes
    return total - sum(x.nbytes for path, x in jax.tree_util.tree_leaves_with_path(w)
                       if any(getattr(p, "key", None) == "experts" for p in path))


def step_bytes(params, tokens: int, batch: int, ctx: float) -> float:
    c = params.config
    moe_layers = sum(c.is_moe(i) for i in range(c.num_layers))
    latent = batch * ctx * (c.kv_lora_rank + c.qk_rope_head_dim) * 2 * c.num_layers
    return fixed_bytes(params) + moe_layers * distinct_experts(c, tokens) * expert_bytes(params) + latent


class Bench:
    def __init__(self, args, name: str):
        self.args, self.name = args, name
        self.tunings = tunings(args.tunings)
        self.seen: dict = {}
        self.res = {"env": env_info(), "kernels": os.environ.get("JSPEC_KERNELS", "auto"), "tunings": args.tunings}
        print(self.res["env"], flush=True)
        bw = copy_bandwidth()
        self.res["copy_bandwidth"] = bw
        self.ceiling = ceiling_of(bw)
        print("copy bandwidth TB/s", {k: round(v / 1e12, 3) for k, v in bw.items() if isinstance(v, float)},
              flush=True)

    def variants(self, target):
        """(name suffix, target): the target, and with --fp8 its weights rounded to FP8 and
        kept so in device memory (`quantization.quantize_params`: projections and routed
        experts), measured side by side."""
        yield "", target
        if self.args.fp8:
            yield "_fp8", quantize_params(target)

    def log(self, key: str, tname: str, row: dict, what: str):
        self.res[tagged(key, tname, self.seen)] = row
        print(what, tname, rounded(row), flush=True)
        save_json(self.name, self.res)

    def decode_and_mtp(self, parts):
        t0 = time.perf_counter()
        target = random_params(V2_LITE)
        n = sum(x.size for x in jax.tree.leaves(target.weights))
        print(f"V2-Lite shape ready in {time.perf_counter() - t0:.1f}s: {n / 1e9:.2f}B parameters", flush=True)
        self.res["v2lite_parameters"] = n
        batches = [int(b) for b in self.args.batches.split(",")] if "decode" in parts else [1]
        spec_params = None
        if "mtp" in parts:
            draft = MtpDraft(layer_config(V2_LITE))
            dw = jax.jit(lambda k: draft.init(k, V2_LITE.vocab_size))(jax.random.key(1))
            spec_params = target.with_draft(jspec.DraftParams(draft, dw))
        first: dict = {}
        runs = [(tname + suffix, tuning, params) for suffix, params in self.variants(target)
                for tname, tuning in self.tunings]
        for tname, tuning, target in runs:
            ar = {}
            for batch in batches:
                r = Runner(target, prompts(batch, V2_LITE.vocab_size), LONG, tuning=tuning)
                per, _, _ = r.per_round(SHORT, LONG, reps=2)
                tokens = r.run(SHORT)[1].tokens
                first.setdefault(("decode", batch), tokens)
                ctx = CTX + (SHORT + LONG) / 2
                nbytes = step_bytes(target, batch, batch, ctx)
                ar[batch] = per
                self.log(f"v2lite_decode_b{batch}", tname, {
                    "batch": batch, "ms_per_step": per * 1e3, "ms_per_token": per * 1e3 / batch,
                    "tokens_per_s": batch / per, "GB_read_per_step": nbytes / 1e9,
                    "bandwidth_util": nbytes / per / self.ceiling, "compile_s": r.compile_s,
                    "same_tokens_as_first_tuning": tokens == first["decode", batch]}, "decode")
                del r
            if spec_params is None:
                continue
            spec_params = target.with_draft(spec_params.draft)
            moe_layers = V2_LITE.num_layers - V2_LITE.first_k_dense_replace
            for S, K, N in (tuple(int(v) for v in s.split("x")) for s in self.args.rounds.split(",")):
                r = Runner(spec_params, prompts(1, V2_LITE.vocab_size), LONG,
                           spec=jspec.SpecConfig(num_steps=S, topk=K, num_draft_tokens=N), tuning=tuning)
                per, _, _ = r.per_round(SHORT, LONG, reps=2)
                tokens = r.run(LONG)[1].tokens
                first.setdefault(("mtp", S, K, N), tokens)
                self.log(f"v2lite_mtp_S{S}_K{K}_N{N}", tname, {
                    "S": S, "K": K, "N": N, "ms_per_round": per * 1e3, "ratio_to_ar_step": per / ar[1],
                    "verify_experts_per_layer": distinct_experts(V2_LITE, N),
                    "verify_expert_GB": moe_layers * distinct_experts(V2_LITE, N) * expert_bytes(target) / 1e9,
                    "draft_expert_GB_per_step": distinct_experts(V2_LITE, K) * expert_bytes(target) / 1e9,
                    "compile_s": r.compile_s, "same_tokens_as_first_tuning": tokens == first["mtp", S, K, N]},
                    "mtp round")
                del r
        del target, spec_params

    def v3_layers(self):
        """Per-layer decode time of the V3 layer shape under each tuning, same weights."""
        batch = self.args.batch
        lo, hi = self.args.v3_layers or ((1, 3) if device_memory() >= 100e9 else (1, 2))
        self.res["v3_layers"] = [lo, hi]
        tag = "" if batch == 1 else f"_b{batch}"
        times, nbytes = {}, {}
        for layers in (lo, hi):
            cfg = V3_LAYER.replace(num_layers=layers)
            for suffix, target in self.variants(random_params(cfg)):
                for tname, tuning in self.tunings:
                    r = Runner(target, prompts(batch, cfg.vocab_size), LONG, tuning=tuning)
                    per, _, _ = r.per_round(SHORT, LONG, reps=2)
                    times[tname + suffix, layers] = per
                    print(f"V3 shape, {layers} layers, batch {batch}, {tname + suffix}: {per * 1e3:.3f} ms/step",
                          flush=True)
                    del r
                    w = target.weights["params"]["layers_0"]
                    attn = sum(x.nbytes for x in jax.tree.leaves(w["self_attn"]))
                    shared = sum(x.nbytes for x in jax.tree.leaves(w["mlp"]["shared_experts"]))
                    router = sum(x.nbytes for x in jax.tree.leaves(w["mlp"]["router"]))
                    latent = batch * (CTX + (SHORT + LONG) / 2) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
                    nbytes[tname + suffix] = (attn + shared + router + latent
                                              + distinct_experts(cfg, batch) * expert_bytes(target))
                del target
        for name, b in nbytes.items():
            per_layer = (times[name, hi] - times[name, lo]) / (hi - lo)
            self.log(f"v3_layer_decode{tag}", name, {
                "batch": batch, "layers": [lo, hi], "ms_per_step": [times[name, lo] * 1e3, times[name, hi] * 1e3],
                "ms_per_layer": per_layer * 1e3, "GB_per_layer": b / 1e9,
                "bandwidth_util": b / per_layer / self.ceiling}, "v3 layer")

    def ab(self):
        """V2-Lite with --layers layers under each tuning on the same weights."""
        layers, batch = self.args.layers, self.args.batch
        cfg = V2_LITE.replace(num_layers=layers)
        target = random_params(cfg)
        tokens = None
        for tname, tuning in self.tunings:
            r = Runner(target, prompts(batch, cfg.vocab_size), LONG, tuning=tuning)
            per = r.per_round(SHORT, LONG, reps=3)[0]
            runs = sorted(r.run(SHORT)[0] for _ in range(5))
            out = r.run(SHORT)[1].tokens
            tokens = tokens or out
            fixed = runs[2] - SHORT * per  # a run's time beside its steps (inputs, prefill, outputs)
            self.log(f"ab_{layers}l_b{batch}", tname, {
                "layers": layers, "batch": batch, "ms_per_step": per * 1e3, "same_tokens": out == tokens,
                "ms_16_token_runs": [round(t * 1e3, 2) for t in runs], "ms_fixed_per_run": fixed * 1e3}, "ab")
            del r
        del target


# --------------------------------------------------------------------------- dsa

def layered(one: jspec.Params, layers: int) -> jspec.Params:
    """`one` (a one-layer target) with `layers` layers that all hold layer 0's arrays: the
    shape and the reads of `layers` layers in the memory of one (two V3 MoE layers and
    their random initialisation do not fit an H100's 80 GB)."""
    w = dict(one.weights["params"])
    w.update({f"layers_{i}": w["layers_0"] for i in range(1, layers)})
    return jspec.Params(config=one.config.replace(num_layers=layers), weights={"params": w})


def mtp_draft(target: jspec.Params) -> jspec.DraftParams:
    """A random MTP layer of the target's shape whose decoder layer holds the target's
    layer 0 arrays (see `layered`); its own projection and norms made here."""
    draft = MtpDraft(layer_config(target.config))
    shapes = jax.eval_shape(lambda k: draft.init(k, target.config.vocab_size), jax.random.key(1))["params"]
    own = {name: jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), leaf) for name, leaf in shapes.items()
           if name != "block"}
    own["eh_proj"] = {"kernel": (jax.random.normal(jax.random.key(2), shapes["eh_proj"]["kernel"].shape, jnp.float32)
                                 * 0.02).astype(shapes["eh_proj"]["kernel"].dtype)}
    return jspec.DraftParams(draft, {"params": {**own, "block": target.weights["params"]["layers_0"]}})


def mtp_ratios(target, ctx: int, rounds: int, plain_row=None) -> dict:
    """A random MTP layer of the target's shape: chain S=3 and tree (3,2,4) rounds at batch
    1 as ratios to one plain step."""
    p = target.with_draft(mtp_draft(target))
    step = plain_row["dsa_ms"] / 1e3 if plain_row else step_time(target, 1, ctx, rounds)
    out = {"ctx": ctx, "plain_ms": step * 1e3}
    for name, spec in (("chain_3_1_4", jspec.SpecConfig(3)), ("tree_3_2_4", jspec.SpecConfig(3, 2, 4))):
        t = step_time(p, 1, ctx, rounds, spec)
        out[f"{name}_ms"], out[f"{name}_ratio"] = t * 1e3, t / step
    return out


def check_kernels_at(B, T, H, Dc, Dr, S, Ki, P, dtype, paged, Hi=64, Di=128):
    """Both kernels at one shape against their references: max errors, us a call."""
    rng = np.random.RandomState(0)
    q_lat = jnp.asarray(rng.randn(B, T, H, Dc), dtype)
    q_pe = jnp.asarray(rng.randn(B, T, H, Dr), dtype)
    if paged:
        table = jnp.asarray(np.array([[b + B * g for g in range(S // P)] for b in range(B)], np.int32))
        buf = jnp.asarray(rng.randn(B * S // P + 1, P, Dc + Dr) * 0.5, dtype)
        kbuf = jnp.asarray(rng.randn(B * S // P + 1, P, Di), dtype)
    else:
        table = None
        buf = jnp.asarray(rng.randn(B, S + 1, Dc + Dr) * 0.5, dtype)
        kbuf = jnp.asarray(rng.randn(B, S + 1, Di), dtype)
    index = np.full((B, T, Ki), -1, np.int32)
    for b in range(B):
        for t in range(T):
            n = Ki if (b + t) % 3 else Ki // 3
            index[b, t, :n] = rng.choice(S, n, replace=False)
    index = jnp.asarray(index)
    ref = sparse_mla_reference(q_lat, q_pe, buf, table, index, scale=0.1)
    got = sparse_mla_attention(q_lat, q_pe, buf, table, index, scale=0.1)
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref.astype(jnp.float32))))
    scale = float(jnp.max(jnp.abs(ref.astype(jnp.float32))))
    q = jnp.asarray(rng.randn(B, T, Hi, Di), dtype)
    w = jnp.asarray(rng.randn(B, T, Hi), jnp.float32)
    sref = index_scores_reference(q, w, kbuf, table, scale=Di ** -0.5)
    sgot = index_scores(q, w, kbuf, table, scale=Di ** -0.5)
    serr = float(jnp.max(jnp.abs(sgot - sref)))
    sscale = float(jnp.max(jnp.abs(sref)))
    f = jax.jit(lambda *a: sparse_mla_attention(*a, scale=0.1))
    g = jax.jit(lambda *a: index_scores(*a, scale=Di ** -0.5))

    def t(fn, *a):
        jax.block_until_ready(fn(*a)); t0 = time.perf_counter()
        for _ in range(20): r = fn(*a)
        jax.block_until_ready(r); return (time.perf_counter() - t0) / 20 * 1e6
    print(f"B{B} T{T} H{H} S{S} Ki{Ki} P{P} {jnp.dtype(dtype).name} paged={paged}: sparse mla err {err:.3g} "
          f"(max {scale:.3g}) {t(f, q_lat, q_pe, buf, table, index):.1f} us; index err {serr:.3g} (max {sscale:.3g}) "
          f"{t(g, q, w, kbuf, table):.1f} us", flush=True)

def check_kernels() -> None:
    """The DSA kernels compiled (on the GPU) against their references: a tiny float32 shape
    and the V3.2 shape at 4k and 16k slots, dense and paged 64; max errors and us a call."""
    for paged in (False, True):
        check_kernels_at(2, 3, 4, 32, 16, 40, 20, 4, jnp.float32, paged, Hi=6, Di=16)
        check_kernels_at(1, 1, 128, 512, 64, 4096, 2048, 64, jnp.bfloat16, paged)
        check_kernels_at(2, 4, 128, 512, 64, 16384, 2048, 64, jnp.bfloat16, paged)


def dsa_main(argv):
    """`dsa` (the module docstring)."""
    ap = argparse.ArgumentParser(prog="deepseek.py dsa")
    ap.add_argument("--contexts", default="4096,16384,65536")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--layers", default="1,2")
    ap.add_argument("--rounds", type=int, default=32)
    ap.add_argument("--shape", default="v32", choices=["v32", "tiny"])
    ap.add_argument("--mtp", action="store_true", help="MTP chain and tree round ratios at batch 1")
    ap.add_argument("--check", action="store_true", help="only the kernels against their references")
    ap.add_argument("--topk", action="store_true", help="only the top-k selection kernels (see topk_bench)")
    ap.add_argument("--topk-rows", default="1,32,128")
    ap.add_argument("--topk-tiles", default=TOPK_TILES)
    args = ap.parse_args(argv)
    if args.check:
        check_kernels()
        return
    if args.topk:
        topk_bench(args)
        return
    base = V32_LAYER if args.shape == "v32" else V32_TINY
    lo, hi = (int(x) for x in args.layers.split(","))
    res = {"env": env_info(), "shape": args.shape, "rows": []}
    one = random_params(base.replace(num_layers=1))
    for layers in (lo, hi):
        sparse = layered(one, layers)
        dense = jspec.Params(config=sparse.config.replace(index_topk=0), weights=sparse.weights)
        for ctx in (int(c) for c in args.contexts.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                row = {"layers": layers, "ctx": ctx, "batch": batch}
                for name, p in (("dsa", sparse), ("dense", dense)):
                    row[f"{name}_ms"] = step_time(p, batch, ctx, args.rounds) * 1e3
                res["rows"].append(row)
                print(rounded(row), flush=True)
                save_json(f"dsa_{args.shape}.json", res)
            if args.mtp and layers == hi:
                res.setdefault("mtp", []).append(mtp_ratios(sparse, ctx, args.rounds, row if row["batch"] == 1 else
                                                            None))
                print(rounded(res["mtp"][-1]), flush=True)
                save_json(f"dsa_{args.shape}.json", res)
        del sparse, dense
    per = {}
    for r in res["rows"]:
        per.setdefault((r["ctx"], r["batch"]), {})[r["layers"]] = r
    res["per_layer"] = [{"ctx": c, "batch": b, **{f"{n}_ms_per_layer": (v[hi][f"{n}_ms"] - v[lo][f"{n}_ms"]) / (hi - lo)
                                                  for n in ("dsa", "dense")}}
                        for (c, b), v in per.items() if lo in v and hi in v]
    for r in res["per_layer"]:
        print(rounded(r), flush=True)
    print("saved", save_json(f"dsa_{args.shape}.json", res))


# --------------------------------------------------------------------------- top-k selection

TOPK_TILES = "512/auto/4/2,1024/auto/4/2,256/auto/4/2,512/auto/8/2,512/auto/4/2/256"


def topk_tiles(spec: str) -> list[dict]:
    """"chunk/block/num_warps/num_stages[/min_programs],..." (block "auto": tiles_for's) ->
    topk_slots keyword arguments, one dict an entry."""
    out = []
    for entry in spec.split(","):
        f = entry.split("/")
        t = {"chunk": int(f[0]), "block": None if f[1] == "auto" else int(f[1]), "num_warps": int(f[2]),
             "num_stages": int(f[3])}
        if len(f) > 4:
            t["min_programs"] = int(f[4])
        out.append(t)
    return out


def median_us(fn, x, calls: int = 20) -> float:
    """Median us a call of fn(x) (compiled and warmed first), each call waited for."""
    jax.block_until_ready(fn(x))
    jax.block_until_ready(fn(x))
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e6


def topk_bench(args) -> None:
    """`dsa --topk`: DSA's top-k selection (`jspec.kernels.dsa.topk`) at k = 2048 for S in
    --contexts slots and R in --topk-rows rows of random float32 scores (the last 64 slots
    -inf, as the cache's slots past the committed length): us a call (median of 20) of the
    kernels (one row per --topk-tiles entry), of their reference (lax.top_k, mask, sort)
    and of plain lax.top_k (the model's call before), and whether the kernels equal the
    reference exactly. --shape tiny: S = context / 16, k = 64 and rows / 32 (a CPU smoke
    test, the kernels in interpret mode). Result: $OUT/dsa_topk_<shape>.json."""
    from jspec.kernels.dsa.topk import tiles_for, topk_slots, topk_slots_reference
    tiny = args.shape == "tiny"
    k = V32_TINY.index_topk if tiny else V32_LAYER.index_topk
    tiles = topk_tiles(args.topk_tiles)
    res = {"env": env_info(), "shape": args.shape, "k": k, "interpret": jax.default_backend() != "gpu", "rows": []}
    reference = jax.jit(lambda x: topk_slots_reference(x, k))
    plain = jax.jit(lambda x: jax.lax.top_k(x, k))
    for ctx in (int(c) for c in args.contexts.split(",")):
        S = ctx // 16 if tiny else ctx
        for R in sorted({max(1, int(r) // 32) if tiny else int(r) for r in args.topk_rows.split(",")}):
            rng = np.random.default_rng(S + R)
            x = rng.standard_normal((R, S + 64)).astype(np.float32)
            x[:, S:] = -np.inf
            x = jnp.asarray(x)
            row = {"S": S + 64, "rows": R, "k": k, "reference_us": median_us(reference, x),
                   "top_k_us": median_us(plain, x), "kernels": []}
            want = np.asarray(reference(x))
            for t in tiles:
                fn = jax.jit(lambda x, t=t: topk_slots(x, k, **t))
                block, chunk = tiles_for(R, S + 64, block=t["block"], chunk=t["chunk"],
                                         min_programs=t.get("min_programs", 1024))
                got = np.asarray(fn(x))
                row["kernels"].append({**t, "block_used": block, "chunk_used": chunk, "us": median_us(fn, x),
                                       "exact": bool(np.array_equal(got, want))})
            best = min(row["kernels"], key=lambda r: r["us"])
            row.update(kernel_us=best["us"], kernel_tiles=best, exact=all(r["exact"] for r in row["kernels"]))
            res["rows"].append(row)
            print({k_: v for k_, v in rounded(row).items() if k_ not in ("kernels", "kernel_tiles")},
                  "best", {k_: best[k_] for k_ in ("chunk", "block_used", "num_warps", "num_stages")},
                  "all us", [round(r["us"], 1) for r in row["kernels"]], flush=True)
            save_json(f"dsa_topk_{args.shape}.json", res)
    print("saved", save_json(f"dsa_topk_{args.shape}.json", res))


# --------------------------------------------------------------------------- main

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["dsa"]:
        return dsa_main(argv[1:])
    if argv[:1] in (["prefill"], ["transformers_prefill"]):
        lengths = [int(a) for a in argv[1:] if not a.startswith("--")] or [4096, 32768, 65536]
        if argv[0] == "transformers_prefill":
            return transformers_prefill_bench(V2_LITE, "transformers_prefill_v2_lite.json", lengths)
        absorbed = jspec.Tuning(mla_decode=MlaDecodeTiles(expanded_prompt_blocks=False))
        tag = os.environ.get("JSPEC_BENCH_TAG", "")
        return prefill_bench(V2_LITE, f"prefill_v2_lite{'_' + tag if tag else ''}.json", lengths,
                             [None] + [absorbed] * ("--absorbed" in argv), reps={65536: 2}, fp8="--fp8" in argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("parts", nargs="*", help=f"of {', '.join(PARTS)}, or dsa (default: decode mtp v3layer)")
    ap.add_argument("--tunings", default="default", help="comma-separated common.TUNINGS names")
    ap.add_argument("--batches", default="1,32", help="decode's batches")
    ap.add_argument("--rounds", default="1x1x2,2x1x3,3x1x4,3x2x4", help="mtp's rounds, SxKxN")
    ap.add_argument("--batch", type=int, default=1, help="v3layer's and ab's batch")
    ap.add_argument("--layers", type=int, default=6, help="ab's V2-Lite layers")
    ap.add_argument("--fp8", action="store_true", help="decode, mtp and v3layer also with the weights rounded to "
                    "FP8 and kept so (projections and routed experts), side by side")
    ap.add_argument("--v3-layers", type=lambda v: tuple(int(x) for x in v.split(",")), default=None,
                    help="v3layer's two layer counts, lo,hi")
    args = ap.parse_args(argv)
    parts = set(args.parts) or {"decode", "mtp", "v3layer"}
    if parts - set(PARTS):
        ap.error(f"unknown parts {sorted(parts - set(PARTS))}; parts: {', '.join(PARTS)}")
    tag = os.environ.get("JSPEC_BENCH_TAG", "")
    b = Bench(args, f"deepseek{'_' + tag if tag else ''}.json")
    if parts & {"decode", "mtp"}:
        b.decode_and_mtp(parts)
    if "v3layer" in parts:
        b.v3_layers()
    if "ab" in parts:
        b.ab()
    print("saved", save_json(b.name, b.res))


if __name__ == "__main__":
    main()
