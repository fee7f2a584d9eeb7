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
`--layers`' larger count (random weights: what a round costs, not what it accepts).

    PYTHONPATH=. python3 benchmarks/dsa.py [--contexts 4096,16384,65536] [--batches 1,32]
        [--layers 1,2] [--rounds 32] [--mtp] [--shape v32|tiny]
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


def mtp_ratios(target, ctx: int, rounds: int, plain_row=None) -> dict:
    """A random MTP layer of the target's shape: chain S=3 and tree (3,2,4) rounds at batch
    1 as ratios to one plain step."""
    from jspec.drafts import MtpDraft
    from jspec.drafts.mtp import layer_config
    draft = MtpDraft(layer_config(target.config))
    dw = jax.jit(lambda k: draft.init(k, target.config.vocab_size))(jax.random.key(1))
    p = target.with_draft(jspec.DraftParams(draft, dw))
    step = plain_row["dsa_ms"] / 1e3 if plain_row else step_time(target, 1, ctx, rounds)
    out = {"ctx": ctx, "plain_ms": step * 1e3}
    for name, spec in (("chain_3_1_4", jspec.SpecConfig(3)), ("tree_3_2_4", jspec.SpecConfig(3, 2, 4))):
        t = step_time(p, 1, ctx, rounds, spec)
        out[f"{name}_ms"], out[f"{name}_ratio"] = t * 1e3, t / step
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="4096,16384,65536")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--layers", default="1,2")
    ap.add_argument("--rounds", type=int, default=32)
    ap.add_argument("--shape", default="v32", choices=["v32", "tiny"])
    ap.add_argument("--mtp", action="store_true", help="MTP chain and tree round ratios at batch 1")
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


if __name__ == "__main__":
    main()
