"""DeepSeek-V3.2's sparse attention (DSA) against dense MLA on the same weights: decode
time of the V3.2 layer shape at long contexts, batch 1 and 32 (random bf16 weights).

The caches are filled with random latent rows and indexer keys up to the context instead
of prefilling it (a 64k-token prefill is not what this measures), in a dense layout of
context + 64 slots: a short prompt is admitted, then every row's committed length L is
set to the context, so each decode step attends over (dense) or selects from (DSA) `ctx`
slots. ms a step from `rounds` timed rounds of plain decoding after a warm-up, per layer
count; the per-layer time is the difference over two layer counts. `--mtp` adds, at batch
1 and each context, a random MTP layer of the same shape (with its indexer) and the time
of a chain S=3 and a tree (3,2,4) round as ratios to one plain step of the model with
`--layers`' larger count (random weights: what a round costs, not what it accepts). Every
layer, and the MTP layer's decoder layer, holds layer 0's arrays (`layered`): two V3 MoE
layers and their random initialisation do not fit an H100.

    PYTHONPATH=. python3 benchmarks/dsa.py [--contexts 4096,16384,65536] [--batches 1,32]
        [--layers 1,2] [--rounds 32] [--mtp] [--shape v32|tiny]
    PYTHONPATH=. python3 benchmarks/dsa.py --check   # the kernels against their references
    PYTHONPATH=. python3 benchmarks/dsa.py --topk [--contexts ..] [--topk-rows 1,32,128]
        [--topk-tiles chunk/block/warps/stages,..]   # the top-k selection (topk_bench)
Result: $OUT/dsa.json. Written for the GPU; run on the CPU with --shape tiny only.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from benchmarks.common import V3_LAYER, env_info, random_params, rounded, save_json
from jspec import requests as rq
from jspec.kernels.dsa_index import index_scores, index_scores_reference
from jspec.kernels.mla_sparse import sparse_mla_attention, sparse_mla_reference
from jspec.loop import programs
from jspec.loop.plan import make_plan

V32_LAYER = V3_LAYER.replace(index_topk=2048, index_head_dim=128, index_n_heads=64, model_type="deepseek_v32",
                             architecture="DeepseekV32ForCausalLM")
TINY = V32_LAYER.replace(vocab_size=256, hidden_size=64, intermediate_size=96, num_heads=4, kv_lora_rank=32,
                         q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                         moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                         index_topk=64, index_head_dim=16, index_n_heads=8, dtype="float32")


def filled_state(params, batch: int, ctx: int, rounds: int, spec=None, seed: int = 0):
    """(plan, weights, a loop state whose rows have committed `ctx` random slots, in the
    target's cache and the draft's)."""
    prompt = [[1 + i for i in range(16)]] * batch
    reqs = rq.check_requests(params, prompt, ctx + 8 * rounds, [], {})
    cache = jspec.CacheConfig("dense", max_len=ctx + 8 * rounds + 48)
    plan = make_plan(params, reqs.lens, reqs.max_new, 0, False, cache, spec)
    tw, pw = params.weights, params.draft.weights if params.draft is not None else None
    st, _ = programs.start_jit(plan, tw, pw, *rq.pack(plan, reqs, cache))
    key = jax.random.key(seed)

    def fill(buf):
        nonlocal key
        key, k = jax.random.split(key)
        return (jax.random.normal(k, buf.shape, jnp.float32) * 0.5).astype(buf.dtype)
    st = st.replace(tcache=jax.tree.map(fill, st.tcache), L=jnp.full_like(st.L, ctx))
    if st.proposal is not None:
        st = st.replace(proposal=st.proposal.replace(cache=jax.tree.map(fill, st.proposal.cache)))
    return plan, (tw, pw), st


def step_time(params, batch: int, ctx: int, rounds: int, spec=None) -> float:
    """Seconds a round (a step when spec is None)."""
    plan, (tw, pw), st = filled_state(params, batch, ctx, rounds, spec)
    run = jax.jit(lambda tw, pw, st, n: programs.advance_fn(plan, tw, pw, st, st.step + n), donate_argnums=2)
    st, back = run(tw, pw, st, 2)  # compile and warm
    jax.block_until_ready(back)
    t0 = time.perf_counter()
    st, back = run(tw, pw, st, rounds)
    steps = int(jax.device_get(back["step"])) - 2
    return (time.perf_counter() - t0) / max(steps, 1)


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
    from jspec.drafts import MtpDraft
    from jspec.drafts.mtp import layer_config
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


def main():
    ap = argparse.ArgumentParser()
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
    args = ap.parse_args()
    if args.check:
        check_kernels()
        return
    if args.topk:
        topk_bench(args)
        return
    base = V32_LAYER if args.shape == "v32" else TINY
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
    """`--topk`: DSA's top-k selection (`jspec.kernels.dsa_topk`) at k = 2048 for S in
    --contexts slots and R in --topk-rows rows of random float32 scores (the last 64 slots
    -inf, as the cache's slots past the committed length): us a call (median of 20) of the
    kernels (one row per --topk-tiles entry), of their reference (lax.top_k, mask, sort)
    and of plain lax.top_k (the model's call before), and whether the kernels equal the
    reference exactly. --shape tiny: S = context / 16, k = 64 and rows / 32 (a CPU smoke
    test, the kernels in interpret mode). Result: $OUT/dsa_topk_<shape>.json."""
    from jspec.kernels.dsa_topk import tiles_for, topk_slots, topk_slots_reference
    tiny = args.shape == "tiny"
    k = TINY.index_topk if tiny else V32_LAYER.index_topk
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


if __name__ == "__main__":
    main()
