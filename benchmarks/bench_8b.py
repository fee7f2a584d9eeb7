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

transformers: transformers' decode step on the same shape, as a peer figure: greedy
`generate` from a 1k prompt with a static cache, which makes transformers compile its
decoding forward itself (`CompileConfig(fullgraph=True, mode="reduce-overhead")`:
torch.compile with CUDA graphs); ms per step = the time difference of two lengths over
their step difference (so the prefill cancels), batch 1 and 32. (Compiling `model.forward`
by hand instead failed in transformers 5.17: CUDA-graph outputs overwritten, then a
segmentation fault.)
     PYTHONPATH=. python3 benchmarks/bench_8b.py transformers [batch ...]
Result: $OUT/transformers_8b.json
"""
from __future__ import annotations

import argparse
import os
import sys
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


# --------------------------------------------------------------------------- main

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sampling"]:
        return sampling(argv[1:])
    if argv[:1] == ["transformers"]:
        return transformers_decode([int(b) for b in argv[1:]] or [1, 32])
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
