"""N-gram (prompt lookup) drafts: what the lookup costs, and what it gains on code edits.

Parts (arguments; default: both):
- lookup (GPU): the on-device lookup (`jspec.loop.proposers.ngram.ngram_tree`, max_n 4)
  over a 4k-token history at batch 1 and 32, chain (S=5) and tree (S=5, K=4, N=16), as
  time per call (back-to-back calls of the jitted lookup alone) next to one plain decode
  step of the Llama-3.1-8B shape (random bf16 weights) at the same context and batch.
- bundle: the bundled target on `benchmarks/code_edit_prompts.jsonl` (16 held-out
  standard-library functions followed by the first line of a copy or an edited copy:
  text that repeats its prompt), greedy, batch 1, 128 new tokens: jspec plain decoding,
  n-gram chains and a tree, the bundled EAGLE-3 head, and transformers' plain `generate`
  and prompt lookup (`prompt_lookup_num_tokens`) on the same weights and prompts. tau,
  tokens/s (median over prompts of new tokens over run time) and the ratio to jspec's
  plain decoding; `same` is the share of prompts whose tokens equal jspec's plain output.

Run: PYTHONPATH=. python3 benchmarks/ngram.py [lookup] [bundle]   (CPU: float32, bundle only)
"""
from __future__ import annotations

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from benchmarks.common import (LLAMA31_8B, best_call_time, env_info, prompt_row, random_params, save_json,
                               transformers_row)
from jspec.bundle import bundle_path
from jspec.loop.proposers.ngram import ngram_tree

PROMPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "code_edit_prompts.jsonl")
NEW = 128
CTX = 4096


def ar_step(target, batch: int, rng) -> float:
    """Seconds of one plain decode step at CTX context, `batch` rows. The rows are admitted
    one at a time (`jspec.loop.rows.admit`): a prefill of 32 rows of 4k tokens at once
    would need 64 GiB for the reference attention's scores."""
    from jspec import requests as rq
    from jspec.loop import programs
    from jspec.loop.plan import make_plan

    cache = jspec.CacheConfig("dense")
    reqs = rq.check_requests(target, [rng.randint(1, 100000, size=CTX).tolist() for _ in range(batch)], 64, [], {})
    plan = make_plan(target, reqs.lens, reqs.max_new, 0, False, cache, None)
    rows, adm = rq.pack(plan, reqs, cache)
    st = programs.init_jit(plan)
    for b in range(batch):
        st, _ = programs.admit_jit(plan, target.weights, None, st, rows[b: b + 1], jax.tree.map(lambda a: a[b: b + 1], adm))
    st, back = programs.advance_jit(plan, target.weights, None, st, np.int32(8))  # compiles, warms up
    jax.block_until_ready(back)
    t = time.perf_counter()
    st, back = programs.advance_jit(plan, target.weights, None, st, np.int32(8 + 40))
    jax.block_until_ready(back)
    assert int(back["step"]) == 48 and not back["finished"][:batch].any()
    return (time.perf_counter() - t) / 40


def lookup(res):
    """The lookup alone against one 8B-shape plain decode step, 4k context."""
    target = random_params(LLAMA31_8B)
    rng = np.random.RandomState(0)
    for batch in (1, 32):
        step = ar_step(target, batch, rng)
        W = CTX + 256
        tokens = jnp.asarray(rng.randint(1, 50, size=(batch, W)), jnp.int32)  # a small alphabet: many matches
        L = jnp.full((batch,), CTX, jnp.int32)
        row = {"batch": batch, "ar_step_ms": step * 1e3}
        for name, (S, K, N) in {"chain S=5": (5, 1, 6), "tree 5,4,16": (5, 4, 16)}.items():
            f = jax.jit(lambda t, l, S=S, K=K, N=N: ngram_tree(t, l, 1, 4, S, K, N).tokens)
            per, _ = best_call_time(f, tokens, L, calls=200)
            row[f"{name} us"] = per * 1e6
            row[f"{name} / AR step"] = per / step
        res[f"lookup_b{batch}"] = row
        print("lookup", {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)


def jspec_rows(prompts, dtype):
    root = bundle_path()
    target = jspec.load(os.path.join(root, "target"), dtype=dtype)
    configs = [("jspec plain", None, None),
               ("jspec n-gram chain S=3", jspec.NgramDraft(), jspec.SpecConfig(3)),
               ("jspec n-gram chain S=5", jspec.NgramDraft(), jspec.SpecConfig(5)),
               ("jspec n-gram chain S=8", jspec.NgramDraft(), jspec.SpecConfig(8)),
               ("jspec n-gram tree 5,4,12", jspec.NgramDraft(), jspec.SpecConfig(5, 4, 12)),
               ("jspec EAGLE-3 chain S=5", os.path.join(root, "eagle3"), jspec.SpecConfig(5))]
    rows = {}
    for name, draft, spec in configs:
        params = target if draft is None else (target.with_draft(draft) if isinstance(draft, jspec.NgramDraft)
                                               else jspec.load(os.path.join(root, "target"), draft=draft, dtype=dtype))
        longest = max(prompts, key=len)
        prog = jspec.compile(params, longest, max_new_tokens=NEW, stop_token_ids=[], spec=spec)
        rows[name] = prompt_row(prog, prompts, NEW)
        print(f"{name}: {rows[name]['tokens_per_s']:.0f} tokens/s, tau {rows[name]['tau']:.2f}", flush=True)
    return rows


def transformers_rows(prompts, dtype):
    import torch
    import transformers
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.join(bundle_path(), "target"), dtype=getattr(torch, dtype)).to(dev).eval()
    rows = {}
    for name, kw in [("transformers plain", {}), ("transformers prompt lookup (10 tokens)",
                                                  {"prompt_lookup_num_tokens": 10})]:
        rows[name] = transformers_row(model, prompts, NEW, **kw)
        print(f"{name}: {rows[name]['tokens_per_s']:.0f} tokens/s", flush=True)
    return rows


def bundle(res):
    dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    tok = jspec.load(os.path.join(bundle_path(), "target")).tokenizer
    with open(PROMPTS) as f:
        prompts = [tok(json.loads(line)["prompt"])["input_ids"] for line in f if line.strip()]
    rows = jspec_rows(prompts, dtype)
    try:
        rows.update(transformers_rows(prompts, dtype))
    except Exception as e:  # noqa: BLE001
        res["transformers_error"] = repr(e)[:500]
        print("transformers failed:", repr(e)[:500], flush=True)
    ref, base = rows["jspec plain"]["tokens"], rows["jspec plain"]["tokens_per_s"]
    for name, r in rows.items():
        r["same"] = float(np.mean([a == b for a, b in zip(r.pop("tokens"), ref)]))
        r["ratio_to_jspec_plain"] = r["tokens_per_s"] / base
        print(f"{name:40s} {r['tokens_per_s']:9.1f} tok/s  {r['ratio_to_jspec_plain']:5.2f}x jspec plain  "
              f"tau {r.get('tau', float('nan')):.2f}  same {r['same']:.2f}", flush=True)
    res["bundle"] = {"dtype": dtype, "prompts": len(prompts), "new_tokens": NEW, "rows": rows}


def main(parts):
    res = {"env": env_info()}
    tag = "cpu" if jax.default_backend() == "cpu" else res["env"]["device"].split()[-1].lower()
    if "lookup" in parts:
        lookup(res)
    if "bundle" in parts:
        bundle(res)
    print("saved", save_json(f"ngram_{tag}.json", res))


if __name__ == "__main__":
    main(set(sys.argv[1:]) or ({"bundle"} if jax.default_backend() == "cpu" else {"lookup", "bundle"}))
