"""The bundled pair against transformers' assisted generation, side by side in one run (GPU).

Greedy, batch 1, bfloat16, on held-out standard-library prompts (as bundle_eval.py). Rows:
jspec plain decoding, jspec with the EAGLE-3 head (chain S=3) and with the standalone draft
(chain S=4); transformers plain `generate` and `generate(assistant_model=...)` with the
standalone draft (transformers' assisted generation takes a draft model with the target's
tokenizer; it has no EAGLE-3 heads), both with its default dynamic cache. tokens/s is the
median over prompts of new tokens over wall time; the share of prompts whose output equals
jspec's plain greedy output is reported for each row.

Run: PYTHONPATH=. python3 benchmarks/bundle_vs_transformers.py [--prompts 8]
"""
from __future__ import annotations

import argparse
import os

import jax
import numpy as np

import jspec
from benchmarks.bundle_eval import NEW, PROMPT, held_out_prompts
from benchmarks.common import env_info, prompt_row, save_json, transformers_row
from jspec.bundle import bundle_path


def jspec_rows(prompts):
    root = bundle_path()
    load = lambda draft: jspec.load(os.path.join(root, "target"), dtype="bfloat16",
                                    draft=None if draft is None else os.path.join(root, draft))
    rows = {}
    for name, draft, spec in [("jspec plain", None, None), ("jspec EAGLE-3 chain S=3", "eagle3", jspec.SpecConfig(3)),
                              ("jspec standalone chain S=4", "standalone", jspec.SpecConfig(4))]:
        prog = jspec.compile(load(draft), prompts[0], max_new_tokens=NEW, stop_token_ids=[], spec=spec)
        rows[name] = prompt_row(prog, prompts, NEW)
    return rows


def transformers_rows(prompts):
    import torch
    import transformers
    root = bundle_path()
    load = lambda d: transformers.AutoModelForCausalLM.from_pretrained(
        os.path.join(root, d), dtype=torch.bfloat16).to("cuda").eval()
    target, assistant = load("target"), load("standalone")
    return {name: transformers_row(target, prompts, NEW, **kw)
            for name, kw in [("transformers plain", {}),
                             ("transformers assisted (standalone draft)", {"assistant_model": assistant})]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    args = ap.parse_args()
    tok = jspec.load(os.path.join(bundle_path(), "target")).tokenizer
    prompts = held_out_prompts(tok, args.prompts)
    res = {"env": env_info(), "prompts": len(prompts), "prompt_tokens": PROMPT, "new_tokens": NEW}
    rows = jspec_rows(prompts)
    try:
        rows.update(transformers_rows(prompts))
    except Exception as e:  # noqa: BLE001
        res["transformers_error"] = repr(e)[:500]
        print("transformers failed:", repr(e)[:500], flush=True)
    ref = rows["jspec plain"]["tokens"]
    base = rows["jspec plain"]["tokens_per_s"]
    for name, r in rows.items():
        r["match_jspec_plain"] = float(np.mean([a == b for a, b in zip(r.pop("tokens"), ref)]))
        r["ratio_to_jspec_plain"] = r["tokens_per_s"] / base
        print(f"{name:42s} {r['tokens_per_s']:9.1f} tok/s  {r['ratio_to_jspec_plain']:5.2f}x jspec plain  "
              f"tau {r.get('tau', float('nan')):.2f}  same output {r['match_jspec_plain']:.2f}", flush=True)
    res["rows"] = rows
    print("saved", save_json("bundle_vs_transformers.json", res), jax.__version__)


if __name__ == "__main__":
    main()
