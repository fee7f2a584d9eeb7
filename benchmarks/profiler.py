"""Where the GPU time of a decode step or a round goes: profiler traces of the generation
loop, kernels grouped by name or by loop phase.

decode: the loop of a random-weight target (context 1k): a step timed from two run
  lengths, then a trace of a 40-token run: kernels per step by name (us and calls per
  step), the GPU's busy time and the idle gaps between kernels; the compiled program's
  HLO is saved beside the result, so kernel names can be read back to the operations
  they fuse.
  --model 8b (Llama-3.1-8B shape), v2lite (DeepSeek-V2-Lite, --layers decoder layers:
  the first dense, the rest MoE) or v3layer (--layers DeepSeek-V3 MoE layers);
  --batch; --spec S,K,N: rounds with a random EAGLE-3-shaped head (8b) or MTP layer
  (DeepSeek) instead of plain steps; --tuning: `common.TUNINGS` names (a,b: a profile
  of each, one after the other on the same weights); --devices n:
  the model split over n GPUs, kernels per GPU and stream.
  Under DeepSeek's command buffers (the family's default) the trace shows none of the
  kernels inside the loop's CUDA graph: take --tuning no_graphs to see the decode
  step's kernels (its step is about 8% slower).
phases: the bundled pair, one run per program (plain, and each S,K,N): each kernel
  attributed to the loop phase (`jax.named_scope` in `loop.round.round_step`: draft,
  verify, accept, commit, extend) whose operations it fuses, from the compiled HLO's
  metadata; kernels per round and their time, per phase.

Run: PYTHONPATH=. python3 benchmarks/profiler.py decode [--model 8b] [--batch 1] [--spec S,K,N] [--layers 4]
         [--tuning NAME[,NAME...]] [--devices N] [--top 40]
     PYTHONPATH=. python3 benchmarks/profiler.py phases [S,K,N ...]   (default 4,1,5)
Results: $OUT/profile_<model>_b<batch>[...].json and hlo_<...>.txt; $OUT/profile_phases_<backend>.json
"""
from __future__ import annotations

import argparse
import collections
import os
import re

import jax

import jspec
from benchmarks.common import (LLAMA31_8B, V2_LITE, V3_LAYER, Runner, bench_tag, busy_and_gaps, eagle3_head,
                               env_info, kernel_spans, kernel_stats, out_dir, prompts, random_params,
                               random_split_params, save_json, trace_events, traced, tuning_of)
from jspec import bundle
from jspec.bench import parse_spec
from jspec.drafts import MtpDraft
from jspec.drafts.mtp import layer_config

PROMPT = "def fibonacci(n):\n"
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
            params = params.with_draft(eagle3_head(params)) if spec else params
        return params, spec, 100000
    cfg = (V2_LITE if args.model == "v2lite" else V3_LAYER).replace(num_layers=args.layers)
    if args.devices:
        from benchmarks.tp import random_deepseek_split
        return random_deepseek_split(cfg, args.devices, with_mtp=spec is not None), spec, cfg.vocab_size
    params = random_params(cfg)
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
    layers = "" if args.model == "8b" else f"_{args.layers}l"
    name = "_".join(x for x in (f"profile_{args.model}{layers}_b{args.batch}", bench_tag(args.spec or ""),
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
    save_json(f"{name}.json", {"env": env_info(), "model": args.model, "batch": args.batch, "spec": args.spec,
                               "tuning": tuning_name, "steps": steps, "run_s": secs, "ms_per_step": per * 1e3,
                               "busy_us": busy_us, "gaps_us": [round(g, 2) for g in gaps if g > 0.5],
                               "per_gpu": per_gpu, "kernels": [(kname, n, t) for t, n, kname in rows]})


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
    pair = bundle.load("eagle3", dtype=None if jax.default_backend() == "gpu" else "float32")
    res = {"env": env_info(), "prompt": PROMPT}
    res["plain"] = phase_table(Runner(pair.with_draft(None), [PROMPT], 160), 160)
    for spec in specs:
        res[f"{spec.num_steps},{spec.topk},{spec.num_draft_tokens}"] = phase_table(
            Runner(pair, [PROMPT], 160, spec=spec), 160, f"hlo_phases_{spec.num_steps}x{spec.topk}.txt")
    for k, v in res.items():
        if isinstance(v, dict) and "phases" in v:
            print(k, f"{v['tokens_per_round']:.2f} tokens/round;",
                  "; ".join(f"{p} {x['kernels_per_round']:.1f} kernels {x['us_per_round']:.1f} us"
                            for p, x in v["phases"].items()))
            print("  unmapped:", v["unmapped"])
    print("saved", save_json(f"profile_phases_{jax.default_backend()}.json", res))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=("decode", "phases"))
    ap.add_argument("specs", nargs="*", help="phases: S,K,N shapes (default 4,1,5)")
    ap.add_argument("--model", default="8b", choices=("8b", "v2lite", "v3layer"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--spec", default="", help="decode: S,K,N rounds instead of plain steps")
    ap.add_argument("--layers", type=int, default=4, help="v2lite and v3layer: decoder layers")
    ap.add_argument("--tuning", default="default",
                    help="common.TUNINGS names, comma-separated: one profile each, the model built once")
    ap.add_argument("--devices", type=int, default=0, help="8b: split over this many GPUs (0: unsplit)")
    ap.add_argument("--top", type=int, default=40, help="kernels listed")
    args = ap.parse_args()
    decode(args) if args.mode == "decode" else phases(args)


if __name__ == "__main__":
    main()
