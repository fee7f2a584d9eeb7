"""Where the time of a decode step or a round goes: profiler traces of the generation loop,
kernels grouped by name or by loop phase, and what a round of the bundled pair costs.

decode: the loop of a random-weight target (context 1k): a step timed from two run
  lengths, then a trace of a 40-token run: kernels per step by name (us and calls per
  step), the GPU's busy time and the idle gaps between kernels; the compiled program's
  HLO is saved beside the result, so kernel names can be read back to the operations
  they fuse.
  --model 8b (Llama-3.1-8B shape), v2lite (DeepSeek-V2-Lite, --layers decoder layers:
  the first dense, the rest MoE) or v3layer (--layers DeepSeek-V3 MoE layers);
  --batch; --spec S,K,N: rounds with a random EAGLE-3-shaped head (8b) or MTP layer
  (DeepSeek) instead of plain steps (--draft dflash: a random DFlash drafter of z-lab's
  shape instead of the head, blocks of 16); --phases: also the kernels by loop phase, as
  `phases` attributes them by name (a kernel XLA reuses in two phases, as the drafter's
  and the target's products can be, counts under one of them); --tuning: `common.TUNINGS` names (a,b: a profile
  of each, one after the other on the same weights); --devices n:
  the model split over n GPUs, kernels per GPU and stream; --fp8 (one device): the
  weights rounded to FP8 and kept so, as `deepseek.py --fp8` and `bench_8b.py fp8` run them.
  Under DeepSeek's command buffers (the family's default) the trace shows none of the
  kernels inside the loop's CUDA graph: take --tuning no_graphs to see the decode
  step's kernels (its step is about 8% slower).
phases: the bundled pair (--draft dflash: the target with its DFlash drafter), one run
  per program (plain, and each S,K,N): each kernel
  attributed to the loop phase (`jax.named_scope` in `loop.round.round_step`: draft,
  verify, accept, commit, extend) whose operations it fuses, from the compiled HLO's
  metadata; kernels per round and their time, per phase.
round: what a round of the bundled pair costs on this machine (CPU or GPU), against a
  plain step: the time of one speculative round (the CLI's default chain unless --steps,
  --topk, --tokens) and of a plain step, each from two generation lengths through one
  compiled program; for a chain also the round's model work, timed as separate jitted
  phases of the loop (`jspec.loop.round`) over the state after admission: the target's
  verification over the N nodes (`verify_phase`), the draft's S-1 steps (`propose_phase`)
  and the draft-extend over the committed tokens (`observe_phase`); the round minus that
  work is its fixed cost. On a GPU it also traces one run of each program: kernels per
  step and per round, the time some kernel runs, and the idle time between kernels.
  --products: the target's verification over each of --nodes nodes with jspec's CPU
  products (the default tuning) against XLA's (tuning xla_cpu_products: `Tuning(
  cpu_matmul_max_rows=0)`), compiled side by side and called alternately, --calls calls
  each: minimum, 25th percentile and median (float32; this machine's speed drifts, so only
  same-run ratios count).

Run: PYTHONPATH=. python3 benchmarks/profiler.py decode [--model 8b] [--batch 1] [--spec S,K,N] [--layers 4]
         [--draft eagle3|dflash] [--phases] [--fp8] [--tuning NAME[,NAME...]] [--devices N] [--top 40]
     PYTHONPATH=. python3 benchmarks/profiler.py phases [S,K,N ...]   (default 4,1,5)
     PYTHONPATH=. python3 benchmarks/profiler.py round [--dtype float32] [--steps 4] [--topk K --tokens N]
     PYTHONPATH=. python3 benchmarks/profiler.py round --products [--nodes 1 3 5] [--calls 60]
Results: $OUT/profile_<model>_b<batch>[...].json and hlo_<...>.txt; $OUT/profile_phases_<backend>.json;
     round: $OUT/round_cost_<backend>[_SxKxN].json, $OUT/cpu_products_<backend>.json
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from benchmarks.common import (LLAMA31_8B, V2_LITE, V3_LAYER, Runner, bench_tag, busy_and_gaps, dflash_drafter,
                               eagle3_head, env_info, kernel_spans, kernel_stats, median_time, out_dir, prompts,
                               random_params, random_split_params, save_json, trace_events, traced, tuning_of)
from jspec import bundle
from jspec.bench import parse_spec
from jspec.drafts import MtpDraft
from jspec.drafts.mtp import layer_config
from jspec.loop import programs
from jspec.loop.round import Accepted, observe_phase, propose_phase, verify_phase
from jspec.loop.tree import chain_tree
from jspec.quantization import quantize_params

PROMPT = "def fibonacci(n):\n"
ROUND_PROMPT = "def fibonacci(n):"  # round's (its figures were taken with this prompt)
PHASES = ("draft", "verify", "accept", "commit", "extend")


# --------------------------------------------------------------------------- decode

def model(args):
    """(params, spec or None, vocabulary) of --model, --layers, --spec, --devices."""
    spec = parse_spec(args.spec) if args.spec else None
    if args.model == "8b":
        if args.devices:
            params = random_split_params(LLAMA31_8B, args.devices, with_head=spec is not None)
        else:
            params = random_params(LLAMA31_8B)
            if args.fp8:  # every projection but the LM head rounded to FP8 and kept so, as bench_8b.py fp8
                params = quantize_params(params)
            if spec:
                params = params.with_draft(dflash_drafter(params) if args.draft == "dflash" else eagle3_head(params))
        return params, spec, 100000
    cfg = (V2_LITE if args.model == "v2lite" else V3_LAYER).replace(num_layers=args.layers)
    if args.devices:
        from benchmarks.tp import random_deepseek_split
        return random_deepseek_split(cfg, args.devices, with_mtp=spec is not None), spec, cfg.vocab_size
    params = random_params(cfg)
    if args.fp8:  # the projections and routed experts rounded to FP8 and kept so
        params = quantize_params(params)
    if spec:
        draft = MtpDraft(layer_config(cfg))
        dw = jax.jit(lambda k: draft.init(k, cfg.vocab_size))(jax.random.key(1))
        params = params.with_draft(jspec.DraftParams(draft, dw))
    return params, spec, cfg.vocab_size


def decode(args):
    params, spec, vocab = model(args)
    for tuning_name in args.tuning.split(","):
        decode_profile(args, params, spec, vocab, tuning_name)


def decode_profile(args, params, spec, vocab: int, tuning_name: str):
    """One tuning's profile of `decode` (the model built once for every --tuning)."""
    tuning = None if tuning_name == "default" else tuning_of(tuning_name)
    layers = ("" if args.model == "8b" else f"_{args.layers}l") + ("_fp8" if args.fp8 else "")
    name = "_".join(x for x in (f"profile_{args.model}{layers}_b{args.batch}", bench_tag(args.spec or ""),
                                args.draft if args.spec and args.draft != "eagle3" else "",
                                "" if tuning_name == "default" else tuning_name,
                                f"n{args.devices}" if args.devices else "") if x)
    r = Runner(params, prompts(args.batch, vocab), 144, spec=spec, tuning=tuning)
    per, _, _ = r.per_round(16, 144, reps=2)
    with open(os.path.join(out_dir(), f"hlo_{name[len('profile_'):]}.txt"), "w") as f:
        f.write(r.prog.executable.as_text())
    r.run(40)
    (secs, res), d = traced(lambda: r.run(40))
    steps = max(max(res.stats.rounds), 1)
    planes = trace_events(d)
    stats, spans = kernel_spans(d)
    busy_us, gaps = busy_and_gaps(spans)
    rows = sorted(((v[1], v[0], k) for k, v in stats.items()), reverse=True)
    print(f"{name}: {per * 1e3:.3f} ms/step (timed); {steps} steps in {secs * 1e3:.1f} ms; "
          f"{sum(v[0] for v in stats.values()) / steps:.0f} kernels/step, kernel time "
          f"{sum(v[1] for v in stats.values()) / steps:.0f} us/step, GPU busy {busy_us / steps:.0f} us/step "
          f"({len(planes)} GPU{'s' if len(planes) > 1 else ''} together)")
    print(f"{'us/step':>9} {'calls/step':>10}  name")
    for t, n, kname in rows[:args.top]:
        print(f"{t / steps:9.1f} {n / steps:10.1f}  {kname[:110]}")
    gaps = sorted(gaps, reverse=True)
    big = [g for g in gaps if g > 2.0]
    print(f"idle gaps between kernels: {len(gaps)} in all, {sum(gaps) / 1e3:.2f} ms; {len(big)} over 2 us; per step "
          f"over 2 us: {sum(big[2:]) / steps:.1f} us (the two largest, around the prefill, left out)")
    per_gpu = {}
    if len(planes) > 1:  # kernels of each GPU, by stream
        for plane, events in sorted(planes.items()):
            s, sp = kernel_stats(events)
            b, _ = busy_and_gaps(sp)
            per_gpu[plane] = {"kernels_per_step": sum(v[0] for v in s.values()) / steps,
                              "kernel_us_per_step": sum(v[1] for v in s.values()) / steps,
                              "busy_us_per_step": b / steps}
            print(f" {plane}: " + ", ".join(f"{k} {v:.0f}" for k, v in per_gpu[plane].items()))
        first = sorted(planes)[0]
        by_stream = collections.defaultdict(lambda: [0, 0.0])
        for stream, kname, _, dur in planes[first]:
            by_stream[stream, kname][0] += 1
            by_stream[stream, kname][1] += dur / 1e3
        for (stream, kname), (c, t) in sorted(by_stream.items(), key=lambda kv: -kv[1][1])[:args.top]:
            print(f"   {t / steps:8.1f} us {c / steps:6.1f}x mean {t / c:6.1f}  [{stream}] {kname[:90]}")
    by_phase = None
    if args.phases:  # each kernel's loop phase, from the compiled HLO's named scopes
        by_phase = phase_table(r, 40)
        print(f"{by_phase['tokens_per_round']:.2f} tokens/round; " + "; ".join(
            f"{p} {x['kernels_per_round']:.1f} kernels {x['us_per_round']:.1f} us"
            for p, x in by_phase["phases"].items()))
        for ph, names in by_phase["kernels"].items():
            print(f"  {ph}: " + ", ".join(f"{k} x{n:.1f}" for k, n in list(names.items())[:12]))
    save_json(f"{name}.json", {"env": env_info(), "model": args.model, "batch": args.batch, "spec": args.spec,
                               "draft": args.draft, "tuning": tuning_name, "steps": steps, "run_s": secs,
                               "ms_per_step": per * 1e3, "busy_us": busy_us,
                               "gaps_us": [round(g, 2) for g in gaps if g > 0.5], "per_gpu": per_gpu,
                               "kernels": [(kname, n, t) for t, n, kname in rows], "phases": by_phase})


# --------------------------------------------------------------------------- phases

def op_phases(hlo_text: str) -> dict:
    """HLO instruction name -> the loop phase of its op_name (or 'loop' inside the while
    body outside every phase, 'outside' elsewhere)."""
    out = {}
    for m in re.finditer(r"%([\w.\-]+) = [^\n]*?op_name=\"([^\"]+)\"", hlo_text):
        parts = m.group(2).split("/")
        phase = next((p for p in parts if p in PHASES), "loop" if "while" in m.group(2) else "outside")
        out[_norm(m.group(1))] = phase
    return out


def _norm(name: str) -> str:
    """Kernel and instruction names compared: '.' and '-' in HLO names are '_' in kernels."""
    return re.sub(r"[.\-]", "_", name)


def phase_table(r, max_new: int, hlo_name: str | None = None) -> dict:
    hlo = r.prog.executable.as_text()
    if hlo_name:
        with open(os.path.join(out_dir(), hlo_name), "w") as f:
            f.write(hlo)
    phases = op_phases(hlo)
    r.run(max_new)
    (_, res), d = traced(lambda: r.run(max_new))
    rounds = max(res.stats.rounds)
    table = collections.defaultdict(lambda: [0, 0.0])
    unmapped = collections.Counter()
    names = collections.defaultdict(collections.Counter)
    for events in trace_events(d).values():
        for _, name, _, dur in events:
            ph = phases.get(_norm(name)) or phases.get(_norm(re.sub(r"_impl$", "", name)))
            if ph is None:
                ph = "unmapped"
                unmapped[name[:80]] += 1
            table[ph][0] += 1
            table[ph][1] += dur / 1e3
            names[ph][name[:60]] += 1
    return {"rounds": rounds, "tokens_per_round": res.timing["new_tokens"] / rounds,
            "phases": {k: {"kernels_per_round": v[0] / rounds, "us_per_round": v[1] / rounds}
                       for k, v in sorted(table.items())},
            "unmapped": {k: n / rounds for k, n in unmapped.most_common(12)},
            "kernels": {ph: {k: n / rounds for k, n in c.most_common()} for ph, c in names.items()}}


def phases(args):
    specs = [parse_spec(a) for a in args.specs] or [parse_spec("4,1,5")]
    pair = bundle.load(args.draft, dtype=None if jax.default_backend() == "gpu" else "float32")
    res = {"env": env_info(), "prompt": PROMPT, "draft": args.draft}
    res["plain"] = phase_table(Runner(pair.with_draft(None), [PROMPT], 160), 160)
    for spec in specs:
        res[f"{spec.num_steps},{spec.topk},{spec.num_draft_tokens}"] = phase_table(
            Runner(pair, [PROMPT], 160, spec=spec), 160, f"hlo_phases_{args.draft}_{spec.num_steps}x{spec.topk}.txt")
    for k, v in res.items():
        if isinstance(v, dict) and "phases" in v:
            print(k, f"{v['tokens_per_round']:.2f} tokens/round;",
                  "; ".join(f"{p} {x['kernels_per_round']:.1f} kernels {x['us_per_round']:.1f} us"
                            for p, x in v["phases"].items()))
            print("  unmapped:", v["unmapped"])
    print("saved", save_json(f"profile_phases_{args.draft}_{jax.default_backend()}.json", res))


# --------------------------------------------------------------------------- round

def loop_state(prog):
    """The loop state after the compiled prompts' admission (prefill and the proposer's
    first observe), through the loop's own entry point."""
    tw, pw = prog.weights
    rows, adm = prog.device_inputs(prog.requests())
    return programs.start_jit(prog.plan, tw, pw, rows, adm)[0]


def verify_over(plan, N: int):
    """plan for a verification over N chain nodes (N = 1: plain decoding's)."""
    if N == plan.N:
        return plan
    if N == 1:
        return dataclasses.replace(plan, proposer=None, spec=None)
    return dataclasses.replace(plan, spec=jspec.SpecConfig(num_steps=N - 1))


def verify_fn(plan, N: int):
    """jitted (target weights, state) -> the target's verification of the state's first N
    tokens as a chain (`verify_phase`): (state, Verified)."""
    p = verify_over(plan, N)
    active = jnp.ones((p.batch,), bool)
    return jax.jit(lambda tw, st: verify_phase(p, tw, st, chain_tree(st.tokens[:, :N]), active))


def model_work(prog) -> dict:
    """Seconds of a chain round's phases that run the models: the target's verification
    (N nodes), the draft's S-1 steps, and the draft-extend over N committed tokens."""
    plan, (tw, pw) = prog.plan, prog.weights
    st = loop_state(prog)
    B, N = plan.batch, plan.N
    active = jnp.ones((B,), bool)
    verify = verify_fn(plan, N)
    draft = jax.jit(lambda tw, pw, st: propose_phase(plan, tw, pw, st, active))
    after, verified = verify(tw, st)
    # every node accepted: the path is the chain, already in place; L moves past it
    path = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, N))
    acc = Accepted(accept_len=jnp.full((B,), N, jnp.int32), path=path, path_tokens=st.tokens[:, :N],
                   bonus=st.tokens[:, N], in_place=True)
    after = after.replace(L=after.L + N)
    extend = jax.jit(lambda tw, pw, st, verified, acc: observe_phase(plan, tw, pw, st, verified, acc, active))
    return {"target verify": median_time(verify, tw, st), "draft steps": median_time(draft, tw, pw, st),
            "draft extend": median_time(extend, tw, pw, after, verified, acc)}


def trace(r, max_new: int) -> dict:
    """GPU kernels of one run: per round (or step) kernels, busy us and idle us."""
    r.run(max_new)
    (_, res), d = traced(lambda: r.run(max_new))
    stats, spans = kernel_spans(d)
    busy, gaps = busy_and_gaps(spans)
    n = max(res.stats.rounds)
    gaps = sorted(gaps)[:-2]  # the two largest: around the prefill
    return {"rounds": n, "kernels_per_round": sum(v[0] for v in stats.values()) / n,
            "busy_us_per_round": busy / n, "idle_us_per_round": sum(gaps) / n}


def round_cost(args):
    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    pair = bundle.load("eagle3", dtype=dtype)
    spec = jspec.SpecConfig(num_steps=args.steps, topk=args.topk, num_draft_tokens=args.tokens)
    res = {"env": env_info(), "dtype": dtype, "spec": [spec.num_steps, spec.topk, spec.num_draft_tokens]}
    plain = Runner(pair.with_draft(None), [ROUND_PROMPT], args.max_new)
    step, _, _ = plain.per_round(16, args.max_new)
    r = Runner(pair, [ROUND_PROMPT], args.max_new, spec=spec)
    per, rounds, toks = r.per_round(16, args.max_new)
    work = model_work(r.prog) if spec.topk == 1 else {}
    model = sum(work.values())
    res.update(plain_step_ms=step * 1e3, round_ms=per * 1e3, tokens_per_round=toks / rounds,
               model_work_ms={k: v * 1e3 for k, v in work.items()}, fixed_ms=(per - model) * 1e3 if work else None,
               speedup=(toks / rounds) * step / per)
    if jax.default_backend() == "gpu":
        res["trace"] = {"plain step": trace(plain, args.max_new), "round": trace(r, args.max_new)}
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()}, flush=True)
    tag = f"_{spec.num_steps}x{spec.topk}x{spec.num_draft_tokens}" if spec.topk > 1 else ""
    print("saved", save_json(f"round_cost_{jax.default_backend()}{tag}.json", res))


def products(args):
    """The verification over N nodes, jspec's CPU products against XLA's, alternating."""
    if max(args.nodes) < 2:
        raise SystemExit("--products: some node count must be at least 2")
    pair = bundle.load("eagle3", dtype="float32")
    r = Runner(pair, [ROUND_PROMPT], 160, spec=jspec.SpecConfig(num_steps=max(args.nodes) - 1))
    st, tw = loop_state(r.prog), r.prog.weights[0]
    ways = {"jspec": r.plan.tuning, "XLA": tuning_of("xla_cpu_products")}
    fns = {(N, way): verify_fn(dataclasses.replace(r.plan, tuning=t), N).lower(tw, st).compile()
           for N in args.nodes for way, t in ways.items()}
    times = {k: [] for k in fns}
    for _ in range(args.calls):
        for k, f in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(f(tw, st))
            times[k].append(time.perf_counter() - t)
    res = {"env": env_info(), "calls": args.calls, "ms": {}}
    for (N, way), ts in times.items():
        ms = {q: float(np.percentile(ts, p) * 1e3) for q, p in (("min", 0), ("p25", 25), ("median", 50))}
        res["ms"][f"{N} nodes, {way}"] = ms
        print(f"{N} nodes, {way + ' products':15s}: " + ", ".join(f"{q} {v:.3f} ms" for q, v in ms.items()), flush=True)
    print("saved", save_json(f"cpu_products_{jax.default_backend()}.json", res))


def round_main(argv):
    """`round` (the module docstring)."""
    ap = argparse.ArgumentParser(prog="profiler.py round")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--max-new", type=int, default=160)
    ap.add_argument("--products", action="store_true", help="jspec's CPU products against XLA's")
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--calls", type=int, default=60)
    args = ap.parse_args(argv)
    products(args) if args.products else round_cost(args)


# --------------------------------------------------------------------------- main

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["round"]:
        return round_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=("decode", "phases"), help="(and round, with options of its own: round --help)")
    ap.add_argument("specs", nargs="*", help="phases: S,K,N shapes (default 4,1,5)")
    ap.add_argument("--model", default="8b", choices=("8b", "v2lite", "v3layer"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--spec", default="", help="decode: S,K,N rounds instead of plain steps")
    ap.add_argument("--layers", type=int, default=4, help="v2lite and v3layer: decoder layers")
    ap.add_argument("--fp8", action="store_true", help="one device: the weights rounded to FP8 and kept so "
                    "(`quantization.quantize_params`)")
    ap.add_argument("--tuning", default="default",
                    help="common.TUNINGS names, comma-separated: one profile each, the model built once")
    ap.add_argument("--devices", type=int, default=0, help="8b: split over this many GPUs (0: unsplit)")
    ap.add_argument("--draft", default="eagle3", choices=("eagle3", "dflash"),
                    help="8b with --spec: a random EAGLE-3 head, or a random DFlash drafter of z-lab's shape "
                    "(`common.dflash_drafter`; --spec 15,1,16: blocks of 16); phases: the bundled drafter "
                    "of that name")
    ap.add_argument("--phases", action="store_true", help="decode: also each kernel's loop phase (draft, verify, "
                    "accept, commit, extend), as `phases` gives it")
    ap.add_argument("--top", type=int, default=40, help="kernels listed")
    args = ap.parse_args(argv)
    decode(args) if args.mode == "decode" else phases(args)


if __name__ == "__main__":
    main()
