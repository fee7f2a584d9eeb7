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
"""
from __future__ import annotations

import argparse
import os
import time

import jspec
from benchmarks.common import (CTX, LLAMA31_8B, LONG, SHORT, Runner, ceiling_of, copy_bandwidth, eagle3_head,
                               env_info, kv_bytes, prompts, random_params, rounded, save_json, tagged, tunings,
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("parts", nargs="*", help=f"of {', '.join(PARTS)} (default: decode chain tree)")
    ap.add_argument("--tunings", default="default", help="comma-separated common.TUNINGS names")
    ap.add_argument("--round-batches", default="1", help="batch sizes of the round parts (each also decoded)")
    args = ap.parse_args()
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
