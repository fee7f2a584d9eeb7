"""Llama-3.1-8B-shaped benchmarks with random bf16 weights (H200).

Decode (issue 2): ms/token at batch 1 and 32, context 1k, and bandwidth utilisation =
(weight bytes + KV bytes read per step) / step time / device-to-device copy bandwidth.
Chain rounds (issue 3): time per round for S = 1..5 with an EAGLE-3-shaped head (one
layer, 32k draft vocabulary) as a ratio to one autoregressive step, batch 1.
Tree rounds (issue 5): (S,K,N) = (5,4,8), (5,8,16), (6,10,60), same ratio.

Run: PYTHONPATH=. python3 benchmarks/bench_8b.py [decode|decode1|chain|chain3|tree|tree16|tree60 ...]
(chain3: S=3 only; tree16: (5,8,16) only)
"""
from __future__ import annotations

import os
import sys
import time

import jax
import numpy as np

import jspec
from benchmarks.common import LLAMA31_8B, Runner, copy_bandwidth, eagle3_head, env_info, random_params, save_json

CTX, SHORT, LONG = 1024, 16, 144


def prompts(batch: int, ctx: int = CTX, seed: int = 0):
    rng = np.random.RandomState(seed)
    return [rng.randint(1, min(100000, LLAMA31_8B.vocab_size), size=ctx).tolist() for _ in range(batch)]


def weight_bytes(params) -> int:
    w = params.weights["params"]
    total = sum(x.nbytes for x in jax.tree.leaves(w))
    return total - w["embed_tokens"]["embedding"].nbytes  # only B rows of the table are read


def kv_bytes(cfg, batch: int, ctx: float) -> float:
    return 2 * cfg.num_layers * batch * ctx * cfg.num_kv_heads * cfg.head_dim * 2


def main(parts):
    tag = os.environ.get("JSPEC_BENCH_TAG", "")
    name = f"bench_8b{'_' + tag if tag else ''}.json"
    res = {"env": env_info(), "kernels": os.environ.get("JSPEC_KERNELS", "auto")}
    print(res["env"], flush=True)
    bw = copy_bandwidth()
    res["copy_bandwidth"] = bw
    ceiling = bw.get("cudaMemcpy_d2d", bw["xla_elementwise"])
    print("copy bandwidth TB/s", {k: round(v / 1e12, 3) for k, v in bw.items() if isinstance(v, float)}, flush=True)
    t0 = time.perf_counter()
    target = random_params(LLAMA31_8B)
    wb = weight_bytes(target)
    res["weight_bytes"] = wb
    print(f"weights ready in {time.perf_counter() - t0:.1f}s; {wb / 1e9:.2f} GB read per step", flush=True)

    ar_step = {}
    round_parts = {"chain", "chain3", "tree", "tree16", "tree60"}
    if parts & ({"decode", "decode1"} | round_parts):
        for batch in ((1, 32) if parts & {"decode", "decode1"} else (1,)):
            if batch == 32 and "decode1" in parts:
                continue
            r = Runner(target, prompts(batch), LONG)
            per, rounds, toks = r.per_round(SHORT, LONG)
            ctx = CTX + (SHORT + LONG) / 2
            util = (wb + kv_bytes(LLAMA31_8B, batch, ctx)) / per / ceiling
            ar_step[batch] = per
            row = {"batch": batch, "ms_per_step": per * 1e3, "ms_per_token": per * 1e3 / batch,
                   "tokens_per_s": batch / per, "bandwidth_util": util, "compile_s": r.compile_s}
            res[f"decode_b{batch}"] = row
            print("decode", {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
            save_json(name, res)
            del r
    if parts & round_parts:
        head = eagle3_head(target)
        spec_params = target.with_draft(head)
        shapes = []
        if "chain" in parts:
            shapes += [(s, 1, s + 1) for s in range(1, 6)]
        if "tree" in parts:
            shapes += [(5, 4, 8), (5, 8, 16), (6, 10, 60)]
        if "chain3" in parts and "chain" not in parts:
            shapes += [(3, 1, 4)]
        if "tree16" in parts and "tree" not in parts:
            shapes += [(5, 8, 16)]
        if "tree60" in parts:
            shapes += [(6, 10, 60)]
        for S, K, N in shapes:
            try:
                r = Runner(spec_params, prompts(1), LONG, spec=jspec.SpecConfig(num_steps=S, topk=K, num_draft_tokens=N))
                per, rounds, toks = r.per_round(SHORT, LONG)
                row = {"S": S, "K": K, "N": N, "ms_per_round": per * 1e3, "ratio_to_ar_step": per / ar_step[1],
                       "compile_s": r.compile_s}
                res[f"round_S{S}_K{K}_N{N}"] = row
                print("round", {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
                save_json(name, res)
                del r
            except Exception as e:  # noqa: BLE001
                print("round", (S, K, N), "failed:", repr(e)[:500], flush=True)
    print("saved", save_json(name, res))


if __name__ == "__main__":
    main(set(sys.argv[1:]) or {"decode", "chain", "tree"})
