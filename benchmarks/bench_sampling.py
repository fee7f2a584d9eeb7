"""What sampling costs a round: Llama-3.1-8B shape, random bf16 weights, context 1k (one GPU).

For plain decoding, the EAGLE-3-shaped chain S=3 (target-only and with sampled drafts) and
the tree (S,K,N) = (5,8,16), at batch 1 and 32, one compiled program each, the time per
round under several sampling settings, side by side, as a ratio to the same program's
greedy round:
  greedy        temperature 0
  T=0.7         temperature only
  T=0.7 top-p   top_p 0.9, top_k 50, min_p 0.05 (both threshold searches run)
  penalties     T=0.7 with repetition 1.1, presence 0.3, frequency 0.2
Random weights give near-uniform distributions, so the top-p search runs its full length
and nearly every draft is rejected: this measures cost, not acceptance.

Run: PYTHONPATH=. python3 benchmarks/bench_sampling.py [--batches 1 32] [--shapes plain 3,1,4 3,1,4,q 5,8,16]
"""
from __future__ import annotations

import argparse
import time

import jspec
from benchmarks.common import LLAMA31_8B, LONG, SHORT, Runner, eagle3_head, env_info, prompts, random_params, save_json

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 32])
    ap.add_argument("--shapes", nargs="*", default=["plain", "3,1,4", "3,1,4,q", "5,8,16"])
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
