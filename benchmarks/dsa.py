"""DeepSeek-V3.2's sparse attention (DSA) against dense MLA on the same weights: decode
time of the V3.2 layer shape at long contexts, batch 1 and 32 (random bf16 weights).

The caches are filled with random latent rows and indexer keys up to the context instead
of prefilling it (a 64k-token prefill is not what this measures), in a dense layout of
context + 64 slots: a short prompt is admitted, then every row's committed length L is
set to the context, so each decode step attends over (dense) or selects from (DSA) `ctx`
slots. ms a step from `rounds` timed rounds of plain decoding after a warm-up, per layer
count; the per-layer time is the difference over two layer counts.

    PYTHONPATH=. python3 benchmarks/dsa.py [--contexts 4096,16384,65536] [--batches 1,32]
        [--layers 1,2] [--rounds 32] [--shape v32|tiny]
Result: $OUT/dsa.json. Written for the GPU; run on the CPU with --shape tiny only.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import jspec
from benchmarks.common import V3_LAYER, env_info, random_params, rounded, save_json
from jspec import requests as rq
from jspec.loop import programs
from jspec.loop.plan import make_plan

V32_LAYER = V3_LAYER.replace(index_topk=2048, index_head_dim=128, index_n_heads=64, model_type="deepseek_v32",
                             architecture="DeepseekV32ForCausalLM")
TINY = V32_LAYER.replace(vocab_size=256, hidden_size=64, intermediate_size=96, num_heads=4, kv_lora_rank=32,
                         q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                         moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                         index_topk=64, index_head_dim=16, index_n_heads=8, dtype="float32")


def filled_state(params, batch: int, ctx: int, rounds: int, seed: int = 0):
    """(plan, weights, a loop state whose rows have committed `ctx` random slots)."""
    prompt = [[1 + i for i in range(16)]] * batch
    reqs = rq.check_requests(params, prompt, ctx + rounds, [], {})
    cache = jspec.CacheConfig("dense", max_len=ctx + rounds + 48)
    plan = make_plan(params, reqs.lens, reqs.max_new, 0, False, cache, None)
    tw = params.weights
    st, _ = programs.start_jit(plan, tw, None, *rq.pack(plan, reqs, cache))
    key = jax.random.key(seed)

    def fill(buf):
        nonlocal key
        key, k = jax.random.split(key)
        return (jax.random.normal(k, buf.shape, jnp.float32) * 0.5).astype(buf.dtype)
    tcache = jax.tree.map(fill, st.tcache)
    st = st.replace(tcache=tcache, L=jnp.full_like(st.L, ctx))
    return plan, tw, st


def step_time(params, batch: int, ctx: int, rounds: int) -> float:
    plan, tw, st = filled_state(params, batch, ctx, rounds)
    run = jax.jit(lambda tw, st, n: programs.advance_fn(plan, tw, None, st, st.step + n), donate_argnums=1)
    st, back = run(tw, st, 2)  # compile and warm
    jax.block_until_ready(back)
    t0 = time.perf_counter()
    st, back = run(tw, st, rounds)
    steps = int(jax.device_get(back["step"])) - 2
    return (time.perf_counter() - t0) / max(steps, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="4096,16384,65536")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--layers", default="1,2")
    ap.add_argument("--rounds", type=int, default=32)
    ap.add_argument("--shape", default="v32", choices=["v32", "tiny"])
    args = ap.parse_args()
    base = V32_LAYER if args.shape == "v32" else TINY
    lo, hi = (int(x) for x in args.layers.split(","))
    res = {"env": env_info(), "shape": args.shape, "rows": []}
    for layers in (lo, hi):
        sparse = random_params(base.replace(num_layers=layers))
        dense = jspec.Params(config=sparse.config.replace(index_topk=0), weights=sparse.weights)
        for ctx in (int(c) for c in args.contexts.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                row = {"layers": layers, "ctx": ctx, "batch": batch}
                for name, p in (("dsa", sparse), ("dense", dense)):
                    row[f"{name}_ms"] = step_time(p, batch, ctx, args.rounds) * 1e3
                res["rows"].append(row)
                print(rounded(row), flush=True)
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


if __name__ == "__main__":
    main()
