"""Where the plain decode step's time outside the model goes (8B shape, batch 1, H200):
the step as built, then with parts of the per-step sampling machinery replaced by their
greedy-only form (choose without its lax.cond, no history recording), each its own
compiled program, side by side. On the GPU a lax.cond inside the loop waits for its
predicate on the host, so each one costs a pipeline drain per step.

Run: PYTHONPATH=. python3 benchmarks/decode_overheads.py
"""
from __future__ import annotations

import jax.numpy as jnp

import jspec

from benchmarks.bench_8b import LONG, SHORT, prompts
from benchmarks.common import LLAMA31_8B, Runner, env_info, random_params, save_json
from jspec import sampling

REAL = {"choose": sampling.choose, "record": sampling.record}
VARIANTS = {
    "as built": {},
    "choose without cond": {"choose": lambda logits, *a, **k: jnp.argmax(logits, axis=-1).astype(jnp.int32)},
    "no history record": {"record": lambda hist, tokens, valid: hist},
    "both": {"choose": lambda logits, *a, **k: jnp.argmax(logits, axis=-1).astype(jnp.int32),
             "record": lambda hist, tokens, valid: hist},
}


def main():
    res = {"env": env_info(), "rows": []}
    print(res["env"], flush=True)
    target = random_params(LLAMA31_8B)
    for name, patch in VARIANTS.items():
        for attr, fn in REAL.items():
            setattr(sampling, attr, patch.get(attr, fn))
        jspec.clear_caches()
        for batch in (1,):
            r = Runner(target, prompts(batch), LONG)
            per, rounds, _ = r.per_round(SHORT, LONG)
            res["rows"].append({"variant": name, "batch": batch, "ms_per_step": per * 1e3})
            print(name, batch, round(per * 1e3, 4), flush=True)
            del r
    for attr, fn in REAL.items():
        setattr(sampling, attr, fn)
    print("saved", save_json("decode_overheads.json", res))


if __name__ == "__main__":
    main()
