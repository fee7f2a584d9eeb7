"""Cost of the sampling operations alone on [R, 128256] float32 logits (H200): Gumbel
noise, the top-k and top-p threshold searches (and variants of their reduction), the
filters as `filter_logits` runs them (over candidates, and over whole rows), and a
full-row sort for scale. Rows are N(0, 2^2) (flat: top-p alone must search whole rows)
or N(0, 10^2) (peaked: top-p 0.9 lies among the candidates).

Run: PYTHONPATH=. python3 benchmarks/sampling_ops.py
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import env_info, median_time, save_json
from jspec import sampling

V = 128256


def search_chunked(x, weigh, target, chunk=2048, probes=16):
    """The threshold search with the row reduced in chunks first (more parallel work)."""
    R = x.shape[0]
    bits = int(np.log2(probes))
    pad = (-x.shape[1]) % chunk
    xp = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf).reshape(R, -1, chunk)
    found = jnp.zeros((R,), jnp.uint32)
    digits = jnp.arange(probes, dtype=jnp.uint32)
    shift = 32 - bits
    while shift > -bits:
        s = max(shift, 0)
        probes_ = found[:, None] | (digits[None, :] << s)
        keys, w = sampling._order_keys(xp), weigh(xp)
        mass = jnp.sum(jnp.where(keys[..., None] >= probes_[:, None, None, :], w[..., None], 0), axis=2).sum(1)
        reach = jnp.sum((mass >= target[:, None]).astype(jnp.int32), axis=1)
        found = found | (jnp.maximum(reach - 1, 0).astype(jnp.uint32) << s)
        shift -= bits
    return jnp.where(found == 0, -jnp.inf, sampling._from_order_key(found))


def main():
    res = {"env": env_info(), "rows": []}
    for R in (16, 128, 512):
        x = jax.random.normal(jax.random.key(0), (R, V), jnp.float32) * 2
        k = jnp.full((R,), 50.0)
        seed = jnp.arange(R // 4, dtype=jnp.int32)
        pos = jnp.zeros((R // 4, 4), jnp.int32)
        ops = {
            "gumbel": jax.jit(lambda x: sampling.gumbel(seed, pos, 0, V)),
            "search top-k": jax.jit(lambda x: sampling._largest_value_reaching(x, jnp.ones_like, k)),
            "search top-k chunked": jax.jit(lambda x: search_chunked(x, jnp.ones_like, k)),
            "search top-k chunked 4 probes": jax.jit(lambda x: search_chunked(x, jnp.ones_like, k, probes=4)),
            "search top-k chunked 512": jax.jit(lambda x: search_chunked(x, jnp.ones_like, k, chunk=512)),
            "filter top-p 0.9": jax.jit(lambda x: filt(x, 0, 0.9)),
            "filter top-p 0.9 peaked rows": jax.jit(lambda x: filt(x * 5, 0, 0.9)),
            "filter top-k 50 top-p 0.9 min-p 0.05": jax.jit(lambda x: filt(x, 50, 0.9, 0.05)),
            "same over whole rows": jax.jit(lambda x: rows_only(x, 50, 0.9, 0.05)),
            "lax.top_k 64": jax.jit(lambda x: jax.lax.top_k(x, 64)[0]),
            "sort": jax.jit(lambda x: jnp.sort(x, axis=-1)),
        }
        filt = lambda x, k, p, m=0.0: sampling.filter_logits(x, jnp.full((R,), k, jnp.int32), jnp.full((R,), p),
                                                             jnp.full((R,), m))
        rows_only = lambda x, k, p, m=0.0: sampling.filter_logits(x, jnp.full((R,), k, jnp.int32), jnp.full((R,), p),
                                                                  jnp.full((R,), m), cap=V)
        differ = int(jnp.sum(jnp.isfinite(filt(x, 50, 0.9, 0.05)) != jnp.isfinite(rows_only(x, 50, 0.9, 0.05))))
        want = sampling._largest_value_reaching(x, jnp.ones_like, k)
        assert (search_chunked(x, jnp.ones_like, k) == want).all()
        assert (search_chunked(x, jnp.ones_like, k, probes=4) == want).all()
        row = {"rows": R, "entries kept differently, candidates vs whole rows": differ}
        for name, f in ops.items():
            row[name + " us"] = median_time(f, x) * 1e6
        res["rows"].append(row)
        print({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    save_json("sampling_ops.json", res)


if __name__ == "__main__":
    main()
