"""Greedy speculative output against plain greedy output in bf16 on the GPU, bit for bit
(issue 40): the share of prompts whose outputs are identical, per tuning.

Check (`check`): for each tuning (default: `default` and `row_invariant`), plain decoding
and speculative decoding of the same prompts, and the prompts whose outputs differ with
the first differing token:
- the bundled pair (trained; 16 held-out prompts, PROMPT tokens cut to unequal lengths,
  128 new tokens): EAGLE-3 chain S=4 and tree (5,4,16) dense, the chain paged 16, the
  standalone chain; and batch 1 (the first 4 prompts one at a time, EAGLE-3 chain);
- the Llama-3.1-8B shape with random weights and n-gram drafts (a random model's greedy
  output repeats, so the lookup's drafts are accepted): chain S=4 and tree (4,2,8),
  dense and paged 16, a batch of 4 unequal prompts;
- the DeepSeek-V2-Lite layer shape (MLA + 64 experts, `--deepseek-layers` layers, default
  6) with random weights: n-gram chain S=4 and tree (4,2,8), and a random MTP draft's
  chain S=3 and tree (3,2,4) (its drafts are rejected: the root rows are checked beside
  the others), dense and paged 16, 4 unequal prompts.
Plain decoding of each tuning is its own reference (dense; paged plain is compared too).

command_buffers: do XLA's CUDA-graph command buffers change what the loop computes? Tiny
random Llama and DeepSeek targets (float32), dense and paged (16) caches, four unequal
prompts, 24 greedy tokens through `Compiled.run` and through an `Engine`, with no XLA
options, with the family's own (`TargetFamily.gpu_xla_options`) and with command buffers
over the while loop and its conditionals (`WHILE`, `CONDITIONAL`); prints whether each
equals the run without options, and the token counts and finish reasons.

Run: PYTHONPATH=. python3 benchmarks/bitwise.py [check] [--tunings default,row_invariant] [--prompts 16]
         [--skip bundle 8b deepseek] [--deepseek-layers 6]
     PYTHONPATH=. python3 benchmarks/bitwise.py command_buffers
"""
from __future__ import annotations

import argparse
import os
import time

import jax
import numpy as np

import jspec
from benchmarks.bundle_eval import first_diff, held_out_prompts
from benchmarks.common import LLAMA31_8B, V2_LITE, V32_TINY, env_info, random_params, save_json, tuning_of, tunings
from jspec.bundle import bundle_path

NEW = 128
PAGED = jspec.CacheConfig("paged", page_size=16)


def compare(name, tname, ref, out, res):
    diffs = [first_diff(a, b) for a, b in zip(out, ref)]
    row = {"tuning": tname, "config": name, "identical": sum(d is None for d in diffs), "prompts": len(diffs),
           "first_diff": [(i, d) for i, d in enumerate(diffs) if d is not None]}
    res.setdefault("check", []).append(row)
    print(f"{tname:14s} {name:40s} identical {row['identical']}/{row['prompts']}  first differences "
          f"(prompt, token) {row['first_diff'][:6]}", flush=True)


def run(params, prompts, tuning, spec=None, cache=None):
    kw = dict(max_new_tokens=NEW, stop_token_ids=[], spec=spec, cache=cache)
    if tuning is not None:
        kw["tuning"] = tuning
    return jspec.generate(params, prompts, **kw)


def check_bundle(tname, tuning, n_prompts, res):
    root = bundle_path()
    target = jspec.load(os.path.join(root, "target"), dtype="bfloat16")
    e3 = jspec.load(os.path.join(root, "target"), draft=os.path.join(root, "eagle3"), dtype="bfloat16")
    sa = jspec.load(os.path.join(root, "target"), draft=os.path.join(root, "standalone"), dtype="bfloat16")
    prompts = [p[: 64 + (37 * i) % 64] for i, p in enumerate(held_out_prompts(target.tokenizer, n_prompts))]
    plain = run(target, prompts, tuning).tokens
    compare("bundle plain paged16", tname, plain, run(target, prompts, tuning, cache=PAGED).tokens, res)
    for name, params, spec, cache in [("bundle eagle3 chain S=4", e3, jspec.SpecConfig(4), None),
                                      ("bundle eagle3 tree 5,4,16", e3, jspec.SpecConfig(5, 4, 16), None),
                                      ("bundle eagle3 chain S=4 paged16", e3, jspec.SpecConfig(4), PAGED),
                                      ("bundle eagle3 tree 5,4,16 paged16", e3, jspec.SpecConfig(5, 4, 16), PAGED),
                                      ("bundle standalone chain S=4", sa, jspec.SpecConfig(4), None)]:
        out = run(params, prompts, tuning, spec, cache)
        compare(f"{name} (tau {out.stats.mean_accept_length:.2f})", tname, plain, out.tokens, res)
    one_plain = [run(target, p, tuning).tokens for p in prompts[:4]]
    one_spec = [run(e3, p, tuning, jspec.SpecConfig(4)).tokens for p in prompts[:4]]
    compare("bundle batch 1 eagle3 chain S=4", tname, one_plain, one_spec, res)
    compare("bundle batch 1 plain vs batch 16 plain", tname, plain[:4], one_plain, res)


def check_8b(tname, tuning, target, res):
    rng = np.random.RandomState(0)
    prompts = [rng.randint(1, 100000, size=n).tolist() for n in (300, 517, 129, 1024)]
    plain = run(target, prompts, tuning).tokens
    compare("8b plain paged16", tname, plain, run(target, prompts, tuning, cache=PAGED).tokens, res)
    ngram = target.with_draft(jspec.NgramDraft())
    for name, spec, cache in [("8b ngram chain S=4", jspec.SpecConfig(4), None),
                              ("8b ngram tree 4,2,8", jspec.SpecConfig(4, 2, 8), None),
                              ("8b ngram chain S=4 paged16", jspec.SpecConfig(4), PAGED),
                              ("8b ngram tree 4,2,8 paged16", jspec.SpecConfig(4, 2, 8), PAGED)]:
        out = run(ngram, prompts, tuning, spec, cache)
        compare(f"{name} (tau {out.stats.mean_accept_length:.2f})", tname, plain, out.tokens, res)


def deepseek_params(layers: int):
    """The V2-Lite shape with `layers` layers and a random MTP draft of its layer shape."""
    from jspec.drafts import MtpDraft
    from jspec.drafts.mtp import layer_config
    cfg = V2_LITE.replace(num_layers=layers)
    target = random_params(cfg)
    draft = MtpDraft(layer_config(cfg))
    dw = jax.jit(lambda k: draft.init(k, cfg.vocab_size))(jax.random.key(1))
    return target, target.with_draft(jspec.DraftParams(draft, dw))


def check_deepseek(tname, tuning, target, mtp, res):
    rng = np.random.RandomState(1)
    prompts = [rng.randint(1, 100000, size=n).tolist() for n in (300, 517, 129, 1000)]
    plain = run(target, prompts, tuning).tokens
    compare("v2lite plain paged16", tname, plain, run(target, prompts, tuning, cache=PAGED).tokens, res)
    ngram = target.with_draft(jspec.NgramDraft())
    for name, params, spec, cache in [("v2lite ngram chain S=4", ngram, jspec.SpecConfig(4), None),
                                      ("v2lite ngram tree 4,2,8 paged16", ngram, jspec.SpecConfig(4, 2, 8), PAGED),
                                      ("v2lite mtp chain S=3 paged16", mtp, jspec.SpecConfig(3), PAGED),
                                      ("v2lite mtp tree 3,2,4", mtp, jspec.SpecConfig(3, 2, 4), None)]:
        out = run(params, prompts, tuning, spec, cache)
        compare(f"{name} (tau {out.stats.mean_accept_length:.2f})", tname, plain, out.tokens, res)


# --------------------------------------------------------------------------- command buffers

# no XLA options; the family's (`TargetFamily.gpu_xla_options`); command buffers over the while loop too
SETTINGS = {"none": "graphs_off", "family": "default", "loop_graphs": "graphs_loop_only"}


def outputs(params, prompts, cache, tuning, new: int = 24) -> dict:
    run = jspec.compile(params, prompts, max_new_tokens=new, stop_token_ids=[], cache=cache, tuning=tuning).run()
    engine = jspec.Engine(params, max_batch=len(prompts), max_prompt_len=64, max_new_tokens=new, cache=cache,
                          tuning=tuning)
    hs = [engine.submit(p, max_new_tokens=new, stop_token_ids=[]) for p in prompts]
    while engine.step():
        pass
    return {"run": [list(map(int, t)) for t in run.tokens], "engine": [list(h.result().tokens) for h in hs],
            "engine_reasons": [h.result().finish_reason for h in hs]}


def command_buffers():
    """`command_buffers` (the module docstring)."""
    from benchmarks.serve_engine import TINY as LLAMA_TINY
    prompts = [[int(t) for t in np.random.default_rng(i).integers(1, 200, 16 + 5 * i)] for i in range(4)]
    for name, cfg in (("llama", LLAMA_TINY), ("deepseek", V32_TINY.replace(num_layers=2, index_topk=0))):
        params = random_params(cfg)
        for cache in (jspec.CacheConfig("dense"), PAGED):
            outs = {label: outputs(params, prompts, cache, tuning_of(t)) for label, t in SETTINGS.items()}
            ref = outs["none"]
            for label, o in outs.items():
                print(f"{name} {cache.kind} {label}: run equal {o['run'] == ref['run']}, engine equal "
                      f"{o['engine'] == ref['run']}, run lengths {[len(t) for t in o['run']]}, engine reasons "
                      f"{o['engine_reasons']}", flush=True)


# --------------------------------------------------------------------------- main

PARTS = ("check", "command_buffers")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("parts", nargs="*", default=["check"], help=f"of {', '.join(PARTS)} (default: check)")
    ap.add_argument("--tunings", default="default,row_invariant")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--skip", nargs="*", default=[], help="of bundle, 8b, deepseek")
    ap.add_argument("--deepseek-layers", type=int, default=6)
    args = ap.parse_args()
    if set(args.parts) - set(PARTS):
        ap.error(f"unknown parts {sorted(set(args.parts) - set(PARTS))}; parts: {', '.join(PARTS)}")
    if "command_buffers" in args.parts:
        command_buffers()
    if "check" not in args.parts:
        return
    res = {"env": env_info(), "date": time.strftime("%Y-%m-%d"), "new_tokens": NEW,
           "deepseek_layers": args.deepseek_layers}
    print(res["env"], flush=True)
    target = None if "8b" in args.skip else random_params(LLAMA31_8B)
    deepseek = None if "deepseek" in args.skip else deepseek_params(args.deepseek_layers)
    for tname, tuning in tunings(args.tunings):
        t0 = time.perf_counter()
        if "bundle" not in args.skip:
            check_bundle(tname, tuning, args.prompts, res)
        if target is not None:
            check_8b(tname, tuning, target, res)
        if deepseek is not None:
            check_deepseek(tname, tuning, *deepseek, res)
        print(f"{tname}: {time.perf_counter() - t0:.0f} s", flush=True)
        jax.clear_caches()
    print("saved", save_json(f"bitwise_{jax.default_backend()}.json", res))


if __name__ == "__main__":
    main()
