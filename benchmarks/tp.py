"""Tensor parallelism: a Llama target (and an EAGLE-3-shaped head) split over n GPUs.

For each device count n (one process, one run): random bf16 weights made directly in
their split layout (`common.random_split_params`; nothing is assembled on one GPU), then
- decode: ms/step at --batches (default 1 and 32), context 1k, and bandwidth utilisation:
  the bytes a step reads (weights + KV cache, all devices together) / step time / (n x
  one GPU's copy bandwidth);
- rounds: chain S=3 and tree (5,8,16) at batch 1 as a ratio to one AR step;
- allreduce: one all-reduce of a [B, D] bf16 activation (the two per layer), timed as the
  mean of 64 chained in one program; a step has 2 L + 1 of them (embedding included);
- check: the bundled pair on a mesh of n devices against the unsplit path (plain, chain
  and tree; dense and paged16; float32 and bfloat16): whether the tokens are equal.
n = 0 runs the unsplit path (no mesh), the baseline for n = 1.

--tunings repeats decode and allreduce under other XLA options for the all-reduces
(`common.TUNINGS`: ar_one_shot, ar_sync, ar_one_shot_sync, passed as `jspec.Tuning`), same
weights, same process; the decode rows of a tuning other than default are named
decode_b<B>_<tuning>, and each records whether its tokens equal the first tuning's.

Memory: the 70B shape's weights are 141 GB, 70.5 GB a GPU over two; on two H100s (80 GB
each) that leaves about 13 GB a GPU for caches and buffers (--layers 40 --devices 1: what
one of two GPUs holds, on one GPU).

Run: PYTHONPATH=. python3 benchmarks/tp.py --shape 8b --devices 0,1,2 [--layers L]
     [--tunings default,ar_one_shot,ar_sync,ar_one_shot_sync] [--batches 1,32] [decode rounds allreduce check]
Result: $OUT/tp_<shape>.json
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time

# NVLink multicast (NVLS) stays off: on shared hosts a program using it can take the GPUs
# out of service (the lent machines set this already; keep it set here too).
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jspec  # noqa: E402
from benchmarks.common import (CTX, LLAMA31_8B, LLAMA31_70B, LONG, SHORT, Runner, ceiling_of,  # noqa: E402
                               copy_bandwidth, env_info, kv_bytes, prompts, random_split_params, save_json, tagged,
                               tunings, weight_bytes)
from jspec import sharding  # noqa: E402

TINY = dataclasses.replace(LLAMA31_8B, vocab_size=128256, hidden_size=256, intermediate_size=512, num_layers=4,
                           num_heads=8, num_kv_heads=2, head_dim=32, sliding_windows=(0,) * 4)  # a CPU smoke test
SHAPES = {"8b": LLAMA31_8B, "70b": LLAMA31_70B, "tiny": TINY}


def allreduce_us(n: int, batch: int, D: int, options: dict, reps: int = 64) -> float:
    """Mean time of one all-reduce of [batch, D] bf16 over n devices (64 chained), compiled
    with these XLA options; checks the sums."""
    mesh = sharding.make_mesh(n)

    def body(x):
        def one(_, y):
            return jax.lax.psum(y, sharding.AXIS) * (1.0 / n)
        return jax.lax.fori_loop(0, reps, one, x)
    x = jax.device_put(jnp.ones((n * batch, D), jnp.bfloat16), NamedSharding(mesh, P(sharding.AXIS)))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(sharding.AXIS), out_specs=P(sharding.AXIS),
                              check_vma=False)).lower(x).compile(options or None)
    x = x.at[0, 0].set(2.0)  # one value that a wrong reduction would change
    y = np.asarray(jax.block_until_ready(f(x)), np.float32)
    want = np.ones_like(y)
    want[::batch, 0] = (n + 1) / n  # every device's block gets the same sums
    if not np.allclose(y, want, rtol=1e-2):
        raise AssertionError(f"all-reduce with {options} gave wrong sums")
    ts = []
    for _ in range(10):
        t = time.perf_counter()
        jax.block_until_ready(f(x))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) / reps * 1e6


def check(n: int, res: dict):
    """The bundled pair on a mesh of n devices against the unsplit path: equal tokens?"""
    from jspec.bundle import bundle_path
    root = bundle_path()
    rows = res.setdefault(f"check_n{n}", [])
    target, draft = os.path.join(root, "target"), os.path.join(root, "eagle3")
    for dtype in ("float32", "bfloat16"):
        one = jspec.load(target, draft=draft, dtype=dtype)
        split = jspec.load(target, draft=draft, dtype=dtype, devices=n)
        ps = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, x):"]
        for spec in (None, jspec.SpecConfig(3, 1, 4), jspec.SpecConfig(5, 8, 16)):
            for cache in ("dense", jspec.CacheConfig("paged", page_size=16)):
                a = jspec.generate(one, ps, max_new_tokens=64, spec=spec, cache=cache)
                b = jspec.generate(split, ps, max_new_tokens=64, spec=spec, cache=cache)
                rows.append({"dtype": dtype, "spec": str(spec), "cache": str(cache), "equal": a.tokens == b.tokens})
                print(f"n={n} check", rows[-1], flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--devices", default="0,1")
    ap.add_argument("--layers", type=int, default=0, help="fewer layers than the shape's (0: all)")
    ap.add_argument("--tunings", default="default", help="comma-separated common.TUNINGS names (XLA options)")
    ap.add_argument("--batches", default="1,32", help="decode batches")
    ap.add_argument("parts", nargs="*", default=["decode", "rounds", "allreduce"])
    args = ap.parse_args()
    cfg = SHAPES[args.shape]
    if args.layers:
        cfg = cfg.replace(num_layers=args.layers, sliding_windows=(0,) * args.layers)
    tuned = tunings(args.tunings)
    batches = [int(b) for b in args.batches.split(",")] if "decode" in args.parts else []
    if "rounds" in args.parts and 1 not in batches:
        batches = [1] + batches  # the rounds' AR step
    name = f"tp_{args.shape}{'_L' + str(args.layers) if args.layers else ''}.json"
    res = {"env": env_info(), "shape": args.shape, "layers": cfg.num_layers, "gpus": len(jax.devices()),
           "tunings": args.tunings}
    bw = copy_bandwidth(2 << 30 if jax.default_backend() == "gpu" else 2 << 20)
    one_gpu = ceiling_of(bw)
    res["copy_bandwidth_one_gpu"] = one_gpu
    print(res, flush=True)
    seen = {}
    for n in [int(x) for x in args.devices.split(",")]:
        if n > len(jax.devices()):
            print(f"skip n={n}: only {len(jax.devices())} devices", flush=True)
            continue
        row = res[f"n{n}"] = {}
        if "check" in args.parts and n >= 1:
            check(n, res)
            save_json(name, res)
        if "allreduce" in args.parts and n >= 2:
            for tname, tuning in tuned:
                options = dict(tuning.xla_options) if tuning is not None else {}
                for batch in (1, 32):
                    try:
                        us = allreduce_us(n, batch, cfg.hidden_size, options)
                    except Exception as e:  # noqa: BLE001  (an option this XLA does not take)
                        row[tagged(f"allreduce_b{batch}_error", tname, seen)] = repr(e)[:300]
                        print(f"n={n} all-reduce b{batch} {tname}: {e!r}"[:400], flush=True)
                        continue
                    per_step = us * (2 * cfg.num_layers + 1) / 1e3
                    row[tagged(f"allreduce_b{batch}_us", tname, seen)] = us
                    row[tagged(f"allreduce_per_step_b{batch}_ms", tname, seen)] = per_step
                    print(f"n={n} all-reduce b{batch} {tname}: {us:.1f} us, per step {per_step:.3f} ms", flush=True)
            save_json(name, res)
        if not batches:
            continue
        t0 = time.perf_counter()
        params = random_split_params(cfg, n, with_head="rounds" in args.parts)
        wb = weight_bytes(params)
        row.update(weight_bytes=wb, init_s=time.perf_counter() - t0)
        print(f"n={n}: weights ready in {row['init_s']:.1f}s, {wb / 1e9:.2f} GB read per step", flush=True)
        first_tokens = {}
        target = dataclasses.replace(params, draft=None)
        for tname, tuning in tuned:
            ar = {}
            for batch in batches:
                try:
                    r = Runner(target, prompts(batch), LONG, tuning=tuning)
                    per, _, _ = r.per_round(SHORT, LONG)
                    tokens = r.run(SHORT)[1].tokens
                except Exception as e:  # noqa: BLE001
                    row[tagged(f"decode_b{batch}_error", tname, seen)] = repr(e)[:300]
                    print(f"n={n} decode b{batch} {tname}: {e!r}"[:400], flush=True)
                    continue
                first_tokens.setdefault(batch, tokens)
                ar[batch] = per
                ctx = CTX + (SHORT + LONG) / 2
                read = wb + kv_bytes(params.config, batch, ctx)
                row[tagged(f"decode_b{batch}", tname, seen)] = d = {
                    "ms_per_step": per * 1e3, "ms_per_token": per * 1e3 / batch,
                    "bandwidth_util": read / per / (max(n, 1) * one_gpu), "compile_s": r.compile_s,
                    "tokens_equal_first_tuning": tokens == first_tokens[batch]}
                print(f"n={n} decode b{batch} {tname}", {k: round(x, 4) for k, x in d.items()}, flush=True)
                save_json(name, res)
                del r
            if "rounds" in args.parts and 1 in ar:
                for S, K, N in ((3, 1, 4), (5, 8, 16)):
                    r = Runner(params, prompts(1), LONG, spec=jspec.SpecConfig(num_steps=S, topk=K, num_draft_tokens=N),
                               tuning=tuning)
                    per, _, _ = r.per_round(SHORT, LONG)
                    row[tagged(f"round_S{S}_K{K}_N{N}", tname, seen)] = d = {"ms_per_round": per * 1e3,
                                                                            "ratio_to_ar_step": per / ar[1]}
                    print(f"n={n} round {tname}", (S, K, N), {k: round(x, 4) for k, x in d.items()}, flush=True)
                    save_json(name, res)
                    del r
        save_json(name, res)
        del params, target
    print("saved", save_json(name, res))


if __name__ == "__main__":
    main()
