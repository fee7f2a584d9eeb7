"""Acceptance and speed of the bundled pair on held-out standard-library files.

For each held-out file with enough tokens, the prompt is PROMPT tokens from a third of the
way in and the model continues for NEW tokens, greedy. Reports tau (mean accepted length per round) for
the EAGLE-3 chain at S = 3, 4, 5, trees at S = 5, the DFlash drafter's blocks of 16, 8 and
4 and its trees, the standalone draft, and tokens/s
against plain decoding of the same target (batch 1 and the whole batch), plus the share of
prompts whose speculative output equals plain decoding and where the first difference is.

With --temperature T [T ...] it samples instead (seeds per prompt), at each temperature:
plain sampling, EAGLE-3 and standalone chains verified target-only and with sampled
drafts (SpecConfig(sample_drafts=True)), and an EAGLE-3 tree. Target-only verification
emits the tokens plain sampling emits for the same seed (up to rounding), so its `match`
is the share of prompts where rounding never changed a draw.

Run: PYTHONPATH=. python3 benchmarks/bundle_eval.py [--prompts 16] [--dtype float32] [--temperature 0.7 1.0]

transformers: the bundled pair against transformers' assisted generation, side by side in
one run (GPU). Greedy, batch 1, bfloat16, on the same held-out prompts. Rows: jspec plain
decoding, jspec with the EAGLE-3 head (chain S=3) and with the standalone draft (chain
S=4); transformers plain `generate` and `generate(assistant_model=...)` with the standalone
draft (transformers' assisted generation takes a draft model with the target's tokenizer;
it has no EAGLE-3 heads), both with its default dynamic cache. tokens/s is the median over
prompts of new tokens over wall time; the share of prompts whose output equals jspec's
plain greedy output is reported for each row.
     PYTHONPATH=. python3 benchmarks/bundle_eval.py transformers [--prompts 8]
Result: $OUT/bundle_vs_transformers.json

constraint: the speed-up of speculation over plain decoding, free and under a JSON schema
(`JSON_SCHEMA`, a function call's arguments; both sides constrained), batch 1 over
held-out prompts followed by " # the call as JSON: ": plain decoding, the EAGLE-3 chain
S=3 and tree (5,8,16); tokens/s (median over prompts), tau, and the share of prompts whose
output equals plain decoding's.
     PYTHONPATH=. python3 benchmarks/bundle_eval.py constraint [--prompts 8] [--dtype float32]
Result: $OUT/bundle_constraint_<backend>_<dtype>.json

fp8: what FP8 weights cost the bundled pair's quality: the target loaded as trained and
with its projection weights rounded online to block FP8 (`jspec.load(..., quantization=
"fp8")`), greedy over the held-out prompts: the share of the trained model's own greedy
tokens the FP8 model also chooses given the same context (teacher-forced), the share of
free-running positions equal, of tokens before the first difference and of identical
outputs, and the EAGLE-3 chain's tau with each.
     PYTHONPATH=. python3 benchmarks/bundle_eval.py fp8 [--prompts 16] [--dtype float32] [--kv-cache]
Result: $OUT/bundle_fp8_<backend>_<dtype>.json
--kv-cache: the same with the trained weights and keys and values stored in FP8
(`CacheConfig(dtype="float8_e4m3fn")`) against the model's dtype, at scale 1 and with
scales from `jspec.calibrate_kv_scales` on as many other held-out prompts (no
teacher-forced figure: a prompt's own pass attends to its unrounded keys). Result:
bundle_fp8_kv_<backend>_<dtype>.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

import jspec
from benchmarks.common import env_info, prompt_row, save_json, transformers_row
from jspec.bundle import bundle_path
from jspec.train import data as data_mod
from jspec.train.stdlib import split

PROMPT, NEW = 128, 128


def held_out_prompts(tok, n: int, stdlib=None):
    """PROMPT tokens from a third of the way into each held-out file (code, rather than
    the license header and module docstring most files open with)."""
    _, held = split(stdlib)
    out = []
    for f in held:
        try:
            text = data_mod.read_corpus(f)[0]
        except ValueError:  # empty or not UTF-8
            continue
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= PROMPT + NEW:
            start = min(len(ids) // 3, len(ids) - PROMPT - NEW)
            out.append(ids[start: start + PROMPT])
        if len(out) == n:
            break
    return out


def first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def evaluate(args, prompts, target, drafts, kw):
    """One row per configuration at the sampling values of kw (the first: plain decoding);
    drafts: the target with each bundled draft, by name (a missing one: its rows left out)."""
    T = kw.get("temperature", 0.0)

    def measure(name, params, spec):
        jspec.generate(params, prompts, spec=spec, **kw)  # compile
        out = jspec.generate(params, prompts, spec=spec, **kw)
        one = dict(kw, seed=0) if "seed" in kw else kw
        jspec.generate(params, prompts[0], spec=spec, **one)  # compile batch 1
        toks, secs = 0, 0.0
        for i, p in enumerate(prompts[: args.batch1]):
            o = jspec.generate(params, p, spec=spec, **(dict(kw, seed=i) if "seed" in kw else kw))
            toks += len(o.tokens)
            secs += o.timing["run_s"]
        row = {"name": name, "temperature": T, "top_p": kw.get("top_p", 1.0), "tau": out.stats.mean_accept_length, "tok_s_batch": out.timing["tokens_per_s"],
               "tok_s_b1": toks / secs, "tokens": out.tokens}
        return row

    plain = measure("plain", target, None)
    rows = [plain]
    if T == 0:
        configs = [("eagle3 chain S=3", "eagle3", jspec.SpecConfig(3)), ("eagle3 chain S=4", "eagle3", jspec.SpecConfig(4)),
                   ("eagle3 chain S=5", "eagle3", jspec.SpecConfig(5)),
                   ("eagle3 tree S=5 K=4 N=16", "eagle3", jspec.SpecConfig(5, 4, 16)),
                   ("eagle3 tree S=5 K=8 N=32", "eagle3", jspec.SpecConfig(5, 8, 32)),
                   ("eagle3 tree S=8 K=2 N=16", "eagle3", jspec.SpecConfig(8, 2, 16)),
                   ("dflash block 16", "dflash", jspec.SpecConfig(15)), ("dflash block 8", "dflash", jspec.SpecConfig(7)),
                   ("dflash block 4", "dflash", jspec.SpecConfig(3)),
                   ("dflash tree S=15 K=2 N=24", "dflash", jspec.SpecConfig(15, 2, 24)),
                   ("dflash tree S=7 K=4 N=16", "dflash", jspec.SpecConfig(7, 4, 16)),
                   ("standalone chain S=4", "standalone", jspec.SpecConfig(4))]
    else:
        configs = [("eagle3 chain S=3 target-only", "eagle3", jspec.SpecConfig(3)),
                   ("eagle3 chain S=3 sampled drafts", "eagle3", jspec.SpecConfig(3, sample_drafts=True)),
                   ("eagle3 chain S=4 target-only", "eagle3", jspec.SpecConfig(4)),
                   ("eagle3 chain S=4 sampled drafts", "eagle3", jspec.SpecConfig(4, sample_drafts=True)),
                   ("eagle3 tree S=5 K=4 N=16 target-only", "eagle3", jspec.SpecConfig(5, 4, 16)),
                   ("dflash block 16 target-only", "dflash", jspec.SpecConfig(15)),
                   ("dflash block 16 sampled drafts", "dflash", jspec.SpecConfig(15, sample_drafts=True)),
                   ("standalone chain S=4 target-only", "standalone", jspec.SpecConfig(4)),
                   ("standalone chain S=4 sampled drafts", "standalone", jspec.SpecConfig(4, sample_drafts=True))]
    for name, draft, spec in configs:
        if draft not in drafts or (args.only and not any(o in name for o in args.only)):
            continue
        rows.append(measure(name, drafts[draft], spec))
    reference = plain["tokens"]
    for r in rows:
        diffs = [first_diff(a, b) for a, b in zip(r["tokens"], reference)]
        r["match"] = sum(d is None for d in diffs) / len(diffs)
        r["first_diff"] = [d for d in diffs if d is not None]
        r["speedup_b1"] = r["tok_s_b1"] / plain["tok_s_b1"]
        r["speedup_batch"] = r["tok_s_batch"] / plain["tok_s_batch"]
        del r["tokens"]
        print(f"T={T} {r['name']:36s} tau {r['tau']:.2f}  tok/s b1 {r['tok_s_b1']:8.1f} ({r['speedup_b1']:.2f}x)  "
              f"batch {r['tok_s_batch']:8.1f} ({r['speedup_batch']:.2f}x)  match {r['match']:.2f} {r['first_diff'][:5]}",
              flush=True)
    return rows


# --------------------------------------------------------------------------- transformers

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


def against_transformers(argv):
    """`transformers` (the module docstring)."""
    ap = argparse.ArgumentParser(prog="bundle_eval.py transformers")
    ap.add_argument("--prompts", type=int, default=8)
    args = ap.parse_args(argv)
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


JSON_SCHEMA = {"type": "object", "properties": {  # a function call's arguments, as a tool-using model writes them
    "name": {"type": "string", "maxLength": 40}, "args": {"type": "array", "items": {"type": "string"}, "maxItems": 6},
    "returns": {"type": "string"}}, "required": ["name", "args", "returns"]}


def part_args(name: str, argv, prompts: int):
    """A part's options (--prompts, --dtype) -> (args, the bundle's directory, the dtype:
    bfloat16 on a GPU, float32 elsewhere, unless given)."""
    ap = argparse.ArgumentParser(prog=f"bundle_eval.py {name}")
    ap.add_argument("--prompts", type=int, default=prompts)
    ap.add_argument("--dtype", default=None)
    args = ap.parse_args(argv)
    return args, bundle_path(), args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")


def constrained(argv):
    """`constraint` (the module docstring)."""
    args, root, dtype = part_args("constraint", argv, 8)
    target = jspec.load(os.path.join(root, "target"), dtype=dtype)
    eagle3 = target.with_draft(jspec.load_draft(os.path.join(root, "eagle3"), target))
    prompts = [p + target.tokenizer(" # the call as JSON: ", add_special_tokens=False)["input_ids"]
               for p in held_out_prompts(target.tokenizer, args.prompts)]
    res = {"env": env_info(), "prompts": len(prompts), "new_tokens": NEW, "schema": JSON_SCHEMA, "rows": {}}
    for label, constraint in (("free", None), ("json", jspec.JsonSchema(JSON_SCHEMA))):
        for name, params, spec in (("plain", target, None), ("EAGLE-3 chain S=3", eagle3, jspec.SpecConfig(3)),
                                   ("EAGLE-3 tree 5,8,16", eagle3, jspec.SpecConfig(5, 8, 16))):
            prog = jspec.compile(params, prompts[0], max_new_tokens=NEW, stop_token_ids=[], spec=spec,
                                 constraint=constraint)
            rates, taus, toks = [], [], []
            prog.run()
            for p in prompts:
                out = prog.run(p, max_new_tokens=NEW, stop_token_ids=[], constraint=constraint)
                rates.append(len(out.tokens) / out.timing["run_s"])
                taus.append(out.stats.mean_accept_length if spec else 1.0)
                toks.append(out.tokens)
            res["rows"][f"{label} {name}"] = {"tokens_per_s": float(np.median(rates)), "tau": float(np.mean(taus)),
                                              "tokens": toks}
    for label in ("free", "json"):
        base = res["rows"][f"{label} plain"]
        for name in ("plain", "EAGLE-3 chain S=3", "EAGLE-3 tree 5,8,16"):
            r = res["rows"][f"{label} {name}"]
            r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["same_as_plain"] = float(np.mean([a == b for a, b in zip(r["tokens"], base["tokens"])]))
            print(f"{label:5s} {name:22s} {r['tokens_per_s']:9.1f} tok/s  tau {r['tau']:.2f}  speed-up "
                  f"{r['speedup']:.2f}x  same as plain {r['same_as_plain']:.2f}", flush=True)
    for r in res["rows"].values():
        r.pop("tokens")
    print("saved", save_json(f"bundle_constraint_{jax.default_backend()}_{dtype}.json", res))


def fp8_quality(argv):
    """`fp8` (the module docstring)."""
    kv = "--kv-cache" in argv
    args, root, dtype = part_args("fp8", [a for a in argv if a != "--kv-cache"], 16)
    res = {"env": env_info(), "dtype": dtype, "new_tokens": NEW, "rows": {}}
    outs, targets = {}, []
    fp8_cache = jspec.CacheConfig(dtype="float8_e4m3fn")
    settings = ((("cache in the model's dtype", None, None), ("FP8 KV cache", None, fp8_cache),
                 ("FP8 KV cache, calibrated scales", "calibrate", fp8_cache)) if kv else
                (("weights as trained", None, None), ("FP8 weights (online, 128 x 128 blocks)", "fp8", None)))
    for name, quant, cache in settings:
        target = jspec.load(os.path.join(root, "target"), dtype=dtype, quantization=quant if quant == "fp8" else None)
        prompts, others = (lambda ps: (ps[:args.prompts], ps[args.prompts:]))(
            held_out_prompts(target.tokenizer, 2 * args.prompts))
        if quant == "calibrate":  # scales from other held-out prompts than those evaluated
            target = jspec.calibrate_kv_scales(target, others)
        targets.append(target)
        eagle3 = target.with_draft(jspec.load_draft(os.path.join(root, "eagle3"), target))
        plain = jspec.generate(target, prompts, max_new_tokens=NEW, stop_token_ids=[], cache=cache)
        spec = jspec.generate(eagle3, prompts, max_new_tokens=NEW, stop_token_ids=[], spec=jspec.SpecConfig(3),
                              cache=cache)
        outs[name] = plain.tokens
        res["rows"][name] = {"tau": float(spec.stats.mean_accept_length),
                             "spec_equals_plain": float(np.mean([a == b for a, b in zip(spec.tokens, plain.tokens)]))}
    ref = next(iter(outs.values()))
    for (name, got), target in zip(list(outs.items())[1:], targets[1:]):
        same = [sum(x == y for x, y in zip(a, b)) / len(a) for a, b in zip(ref, got)]
        prefix = [(len(a) if first_diff(a, b) is None else first_diff(a, b)) / len(a) for a, b in zip(ref, got)]
        # Teacher-forced: the FP8 model's greedy choice at every position of the trained model's own output
        # (weights only: `jspec.logits` reads no cache, and a prompt's own pass attends to its unrounded keys).
        forced = []
        for p, out in zip(prompts, ref if not kv else ()):
            logits = np.asarray(jspec.logits(target, [p + out]))[0, len(p) - 1:-1]
            forced.append(float(np.mean(np.argmax(logits, axis=-1) == np.asarray(out))))
        res["rows"][name]["agreement"] = {
            "teacher_forced": float(np.mean(forced)) if forced else None, "positions_equal": float(np.mean(same)),
            "tokens_before_first_difference": float(np.mean(prefix)),
            "prompts_identical": float(np.mean([a == b for a, b in zip(ref, got)]))}
        res["rows"][name]["tau_ratio"] = res["rows"][name]["tau"] / res["rows"][next(iter(outs))]["tau"]
    print(json.dumps(res, indent=1), flush=True)
    print("saved", save_json(f"bundle_fp8{'_kv' if kv else ''}_{jax.default_backend()}_{dtype}.json", res))


# --------------------------------------------------------------------------- main

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["transformers"]:
        return against_transformers(argv[1:])
    if argv[:1] == ["constraint"]:
        return constrained(argv[1:])
    if argv[:1] == ["fp8"]:
        return fp8_quality(argv[1:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--batch1", type=int, default=4, help="prompts timed one at a time")
    ap.add_argument("--dtype", default=None, help="float32 (default on CPU) or bfloat16 (default on GPU)")
    ap.add_argument("--bundle", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--only", nargs="*", default=None, help="run only configurations whose name has one of these")
    ap.add_argument("--temperature", type=float, nargs="*", default=[0.0], help="0: greedy (the default)")
    ap.add_argument("--top-p", type=float, default=1.0)
    args = ap.parse_args(argv)
    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    root = args.bundle or bundle_path()
    target = jspec.load(os.path.join(root, "target"), dtype=dtype)
    drafts = {name: jspec.load(os.path.join(root, "target"), draft=os.path.join(root, name), dtype=dtype)
              for name in ("eagle3", "dflash", "standalone") if os.path.isdir(os.path.join(root, name))}
    prompts = held_out_prompts(target.tokenizer, args.prompts)
    res = {"jax": jax.__version__, "device": getattr(jax.devices()[0], "device_kind", "cpu"), "dtype": dtype,
           "date": time.strftime("%Y-%m-%d"), "prompts": len(prompts), "prompt_tokens": PROMPT, "new_tokens": NEW,
           "rows": []}
    for temperature in args.temperature:
        kw = dict(max_new_tokens=NEW, stop_token_ids=[])
        if temperature > 0:
            kw.update(temperature=temperature, top_p=args.top_p, seed=list(range(len(prompts))))
        res["rows"] += evaluate(args, prompts, target, drafts, kw)
    tag = "" if args.temperature == [0.0] else "_sampled"
    name = f"bundle_eval_{jax.default_backend()}_{dtype}{tag}.json"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
