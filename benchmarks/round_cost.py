"""What a round of the bundled pair costs on this machine, against a plain step.

Default: the time of one speculative round (the CLI's default chain unless --steps,
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

Run: PYTHONPATH=. python3 benchmarks/round_cost.py [--dtype float32] [--steps 4] [--topk K --tokens N]
     PYTHONPATH=. python benchmarks/round_cost.py --products [--nodes 1 3 5] [--calls 60]
Results: $OUT/round_cost_<backend>[_SxKxN].json, $OUT/cpu_products_<backend>.json
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from benchmarks.common import (Runner, busy_and_gaps, env_info, kernel_spans, median_time, save_json, traced,
                               tuning_of)
from jspec import bundle
from jspec.loop import programs
from jspec.loop.round import Accepted, observe_phase, propose_phase, verify_phase
from jspec.loop.tree import chain_tree

PROMPT = "def fibonacci(n):"


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
    plain = Runner(pair.with_draft(None), [PROMPT], args.max_new)
    step, _, _ = plain.per_round(16, args.max_new)
    r = Runner(pair, [PROMPT], args.max_new, spec=spec)
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
    r = Runner(pair, [PROMPT], 160, spec=jspec.SpecConfig(num_steps=max(args.nodes) - 1))
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--max-new", type=int, default=160)
    ap.add_argument("--products", action="store_true", help="jspec's CPU products against XLA's")
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--calls", type=int, default=60)
    args = ap.parse_args()
    products(args) if args.products else round_cost(args)


if __name__ == "__main__":
    main()
