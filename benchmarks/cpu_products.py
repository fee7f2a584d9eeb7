"""The target's forward over N nodes of the bundled pair with jspec's CPU products
(kernel backend "auto") against XLA's ("reference"), in one process, alternating: the
minimum, 25th percentile and median of `--calls` calls of each.

Run: PYTHONPATH=. python benchmarks/cpu_products.py [--calls 60] [--nodes 1 3 5]
"""
from __future__ import annotations

import argparse
import time

import jax
import numpy as np

import jspec
from benchmarks.common import Runner, env_info, save_json
from benchmarks.round_cost import PROMPT, target_verify
from jspec import bundle
from jspec.kernels.dispatch import use_backend
from jspec.loop import loop


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 5])
    args = ap.parse_args()
    pair = bundle.load("eagle3", dtype="float32")
    r = Runner(pair, [PROMPT], 160, spec=jspec.SpecConfig(num_steps=max(args.nodes) - 1, topk=1))
    plan, (tw, dw) = r.prog.plan, r.prog.weights
    st = jax.jit(loop.start, static_argnums=0)(plan, tw, dw, jax.device_put(r.prog.inputs()))

    def compiled(N: int, mode: str):
        with use_backend(mode):
            return jax.jit(lambda tw, st: target_verify(plan, tw, st, N)).lower(tw, st).compile()

    fns = {(N, m): compiled(N, m) for N in args.nodes for m in ("auto", "reference")}
    times = {k: [] for k in fns}
    for _ in range(args.calls):
        for k, f in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(f(tw, st))
            times[k].append(time.perf_counter() - t)
    res = {"env": env_info(), "calls": args.calls, "ms": {}}
    for (N, mode), ts in times.items():
        ms = {q: float(np.percentile(ts, p) * 1e3) for q, p in (("min", 0), ("p25", 25), ("median", 50))}
        res["ms"][f"{N} nodes, {'jspec' if mode == 'auto' else 'XLA'}"] = ms
        print(f"{N} nodes, {'jspec products' if mode == 'auto' else 'XLA products '}: "
              + ", ".join(f"{q} {v:.3f} ms" for q, v in ms.items()), flush=True)
    print("saved", save_json("cpu_products_cpu.json", res))


if __name__ == "__main__":
    main()
