"""What the plain decode step pays for sampling (8B shape, random weights, H200), side by
side, each its own compiled program:
  greedy program        requests all greedy: no sampling step (`Plan.sampling` False)
  branch in the loop    the same with the choice under a lax.cond on "does any row
                        sample" (the design before `Plan.sampling`): on the GPU the
                        branch waits for its predicate on the host every step
  sampling program      compiled for sampled requests, run with greedy ones (every row
                        goes through the processing and takes the penalised argmax)
  sampling, T=0.7       the same program sampling

Run: PYTHONPATH=. python3 benchmarks/decode_overheads.py [BATCH ...]
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import jspec
from benchmarks.bench_8b import LONG, SHORT, prompts
from benchmarks.common import LLAMA31_8B, Runner, env_info, random_params, save_json
from jspec import sampling

REAL_CHOOSE = sampling.choose
BATCHES = [int(b) for b in sys.argv[1:]] or [1, 32]


def branching_choose(samples, logits, sp, *args, **kw):
    return jax.lax.cond(jnp.any(sp.temperature > 0), lambda: REAL_CHOOSE(True, logits, sp, *args, **kw),
                        lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32))


def main():
    res = {"env": env_info(), "rows": []}
    print(res["env"], flush=True)
    target = random_params(LLAMA31_8B)
    greedy, sampled = dict(temperature=0.0), dict(temperature=0.7)
    variants = [("greedy program", REAL_CHOOSE, greedy, greedy),
                ("branch in the loop", branching_choose, sampled, greedy),
                ("sampling program", REAL_CHOOSE, sampled, greedy),
                ("sampling, T=0.7", REAL_CHOOSE, sampled, sampled)]
    for batch in BATCHES:
        for name, choose, compiled_with, run_with in variants:
            sampling.choose = choose
            jspec.clear_caches()
            r = Runner(target, prompts(batch), LONG, **compiled_with)
            per, _, _ = r.per_round(SHORT, LONG, **run_with)
            res["rows"].append({"variant": name, "batch": batch, "ms_per_step": per * 1e3})
            print(batch, name, round(per * 1e3, 4), flush=True)
            del r
    sampling.choose = REAL_CHOOSE
    print("saved", save_json("decode_overheads.json", res))


if __name__ == "__main__":
    main()
