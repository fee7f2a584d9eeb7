"""Where the routed experts' time goes at one token count: a profiler trace of one path of
`benchmarks/moe_paths.py` (10 calls), GPU kernels grouped by name, us a call.

Run: PYTHONPATH=. python3 benchmarks/moe_profile.py SHAPE N PATH [PATH ...]
(SHAPE v2lite or v3, N tokens, PATH as moe_paths: ragged, grouped, pairs, ...)
"""
from __future__ import annotations

import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import moe_paths
from benchmarks.common import env_info, save_json
from benchmarks.profile_decode import kernel_spans

CALLS = 10


def main(shape: str, N: int, names: list[str]):
    gu, dn = moe_paths.expert_weights(shape)
    ids, x, w = moe_paths.token_inputs(shape, N, np.random.RandomState(0))
    ids = jnp.asarray(ids)
    res = {"env": env_info()}
    for name in names:
        f = jax.jit(getattr(moe_paths, name))
        jax.block_until_ready(f(x, ids, w, gu, dn))
        d = tempfile.mkdtemp()
        jax.profiler.start_trace(d)
        for _ in range(CALLS):
            jax.block_until_ready(f(x, ids, w, gu, dn))
        jax.profiler.stop_trace()
        stats, _ = kernel_spans(d)
        rows = sorted(((v[1] / CALLS, v[0] / CALLS, n) for n, v in stats.items()), reverse=True)
        total = sum(r[0] for r in rows)
        print(f"{shape} N={N} {name}: {total:.1f} us of kernels a call, {sum(r[1] for r in rows):.0f} kernels")
        for t, n, kname in rows[:12]:
            print(f"   {t:8.1f} us {n:4.1f}x  {kname[:90]}")
        res[name] = {"kernel_us": total, "kernels": [(kname, n, t) for t, n, kname in rows]}
    save_json(f"moe_profile_{shape}_N{N}.json", res)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
