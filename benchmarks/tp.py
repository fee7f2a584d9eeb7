"""Tensor parallelism on H200s: a Llama target (and an EAGLE-3-shaped head) split over n GPUs.

For each device count n (one process, one run): random bf16 weights made directly in
their split layout (`jspec.sharding`; nothing is assembled on one GPU), then
- decode: ms/step at batch 1 and 32, context 1k, and bandwidth utilisation: the bytes a
  step reads (weights + KV cache, all devices together) / step time / (n x one GPU's copy
  bandwidth);
- rounds: chain S=3 and tree (5,8,16) at batch 1 as a ratio to one AR step;
- allreduce: one all-reduce of a [B, D] bf16 activation (the two per layer), timed as the
  mean of 64 chained in one program; a step has 2 L + 1 of them (embedding included).
n = 0 runs the unsplit path (no mesh), the baseline for n = 1.

--variants repeats decode and allreduce under other XLA options for the all-reduces
(`VARIANTS`, set through `jspec.kernels.dispatch.GPU_XLA_OPTIONS`), same weights, same process;
the decode rows of a variant other than "xla" are named decode_b<B>_<variant>, and each
records whether its tokens equal the first variant's.

Run: PYTHONPATH=. python3 benchmarks/tp_h200.py --shape 8b --devices 0,1,2 [--layers L]
     [--variants xla,one_shot,sync,one_shot_sync] [--batches 1,32] [decode rounds allreduce]
Result: $OUT/tp_<shape>_h200.json
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
from benchmarks.bench_8b import CTX, LONG, SHORT, kv_bytes, prompts, weight_bytes  # noqa: E402
from benchmarks.common import LLAMA31_8B, Runner, copy_bandwidth, env_info, save_json  # noqa: E402
from jspec import sharding  # noqa: E402
from jspec.kernels import dispatch  # noqa: E402
from jspec.models import family_for  # noqa: E402
from jspec.models.llama import TP_SPLITS, VOCAB_SPLITS, kv_groups  # noqa: E402

LLAMA31_70B = dataclasses.replace(LLAMA31_8B, hidden_size=8192, intermediate_size=28672, num_layers=80,
                                  num_heads=64, num_kv_heads=8, sliding_windows=(0,) * 80)
TINY = dataclasses.replace(LLAMA31_8B, vocab_size=128256, hidden_size=256, intermediate_size=512, num_layers=4,
                           num_heads=8, num_kv_heads=2, head_dim=32, sliding_windows=(0,) * 4)  # a CPU smoke test of this script
SHAPES = {"8b": LLAMA31_8B, "70b": LLAMA31_70B, "tiny": TINY}
# XLA options the loop is compiled with (`jspec.kernels.dispatch.GPU_XLA_OPTIONS`):
# XLA's defaults (jax 0.11.2 already runs these small all-reduces as its Triton one-shot
# kernel), that kernel asked for explicitly, the all-reduces on the compute stream, both.
ONE_SHOT = {"xla_gpu_unsupported_use_all_reduce_one_shot_kernel": True}
SYNC = {"xla_gpu_disable_async_collectives": "ALLREDUCE"}
VARIANTS = {"xla": {}, "one_shot": ONE_SHOT, "sync": SYNC, "one_shot_sync": {**ONE_SHOT, **SYNC}}


def split_init(init, n: int, mesh, key):
    """Random weights made on their devices: init under jit with the split's out_shardings."""
    if mesh is None:
        return jax.jit(init)(key)
    specs = sharding.weight_specs(jax.eval_shape(init, key), n, TP_SPLITS, VOCAB_SPLITS)
    return jax.jit(init, out_shardings=sharding.shardings(mesh, specs))(key)


def random_split_params(cfg, n: int, with_head: bool) -> jspec.Params:
    jax.config.update("jax_default_prng_impl", "rbg")
    mesh = sharding.make_mesh(n) if n else None
    if n:
        cfg = cfg.replace(num_kv_heads=kv_groups(cfg, n))
    family = family_for(cfg)
    w = split_init(lambda k: family.init_weights(cfg, k), n, mesh, jax.random.key(0))
    params = jspec.Params(config=cfg, weights=w, mesh=mesh)
    if with_head:
        m = cfg.replace(num_layers=1, sliding_windows=(0,))
        L = cfg.num_layers
        d = jspec.Eagle3Draft(m, target_hidden_size=cfg.hidden_size, aux_layers=(2, L // 2, L - 3),
                              draft_vocab_size=32000)
        dw = split_init(lambda k: d.init(k, cfg.vocab_size), n, mesh, jax.random.key(1))
        params = params.with_draft(jspec.DraftParams(d, dw))
    return params


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--devices", default="0,1")
    ap.add_argument("--layers", type=int, default=0, help="fewer layers than the shape's (0: all)")
    ap.add_argument("--variants", default="xla", help=f"XLA options to compare, of {sorted(VARIANTS)}")
    ap.add_argument("--batches", default="1,32", help="decode batches")
    ap.add_argument("parts", nargs="*", default=["decode", "rounds", "allreduce"])
    args = ap.parse_args()
    cfg = SHAPES[args.shape]
    if args.layers:
        cfg = cfg.replace(num_layers=args.layers, sliding_windows=(0,) * args.layers)
    variants = args.variants.split(",")
    if not set(variants) <= set(VARIANTS):
        ap.error(f"--variants: each of {sorted(VARIANTS)}")
    batches = [int(b) for b in args.batches.split(",")] if "decode" in args.parts else []
    if "rounds" in args.parts and 1 not in batches:
        batches = [1] + batches  # the rounds' AR step
    name = f"tp_{args.shape}{'_L' + str(args.layers) if args.layers else ''}_h200.json"
    res = {"env": env_info(), "shape": args.shape, "layers": cfg.num_layers, "gpus": len(jax.devices()),
           "variants": {v: VARIANTS[v] for v in variants}}
    bw = copy_bandwidth(2 << 30 if jax.default_backend() == "gpu" else 2 << 20)
    one_gpu = bw.get("cudaMemcpy_d2d", bw["xla_elementwise"])
    res["copy_bandwidth_one_gpu"] = one_gpu
    print(res, flush=True)
    for n in [int(x) for x in args.devices.split(",")]:
        if n > len(jax.devices()):
            print(f"skip n={n}: only {len(jax.devices())} devices", flush=True)
            continue
        row = res[f"n{n}"] = {}
        if "allreduce" in args.parts and n >= 2:
            for v in variants:
                tag = "" if v == "xla" else "_" + v
                for batch in (1, 32):
                    try:
                        us = allreduce_us(n, batch, cfg.hidden_size, VARIANTS[v])
                    except Exception as e:  # noqa: BLE001  (an option this XLA does not take)
                        row[f"allreduce_b{batch}{tag}_error"] = repr(e)[:300]
                        print(f"n={n} all-reduce b{batch} {v}: {e!r}"[:400], flush=True)
                        continue
                    per_step = us * (2 * cfg.num_layers + 1) / 1e3
                    row[f"allreduce_b{batch}{tag}_us"] = us
                    row[f"allreduce_per_step_b{batch}{tag}_ms"] = per_step
                    print(f"n={n} all-reduce b{batch} {v}: {us:.1f} us, per step {per_step:.3f} ms", flush=True)
            save_json(name, res)
        if not batches:
            continue
        t0 = time.perf_counter()
        params = random_split_params(cfg, n, with_head="rounds" in args.parts)
        wb = weight_bytes(params)
        row.update(weight_bytes=wb, init_s=time.perf_counter() - t0)
        print(f"n={n}: weights ready in {row['init_s']:.1f}s, {wb / 1e9:.2f} GB read per step", flush=True)
        first_tokens = {}
        for v in variants:
            tag = "" if v == "xla" else "_" + v
            dispatch.GPU_XLA_OPTIONS = VARIANTS[v]
            ar = {}
            for batch in batches:
                target = dataclasses.replace(params, draft=None)
                try:
                    r = Runner(target, prompts(batch), LONG)
                    per, _, _ = r.per_round(SHORT, LONG)
                    tokens = r.run(SHORT)[1].tokens
                except Exception as e:  # noqa: BLE001
                    row[f"decode_b{batch}{tag}_error"] = repr(e)[:300]
                    print(f"n={n} decode b{batch} {v}: {e!r}"[:400], flush=True)
                    continue
                first_tokens.setdefault(batch, tokens)
                ar[batch] = per
                ctx = CTX + (SHORT + LONG) / 2
                read = wb + kv_bytes(params.config, batch, ctx)
                row[f"decode_b{batch}{tag}"] = d = {"ms_per_step": per * 1e3, "ms_per_token": per * 1e3 / batch,
                                                    "bandwidth_util": read / per / (max(n, 1) * one_gpu),
                                                    "compile_s": r.compile_s,
                                                    "tokens_equal_first_variant": tokens == first_tokens[batch]}
                print(f"n={n} decode b{batch} {v}", {k: round(x, 4) for k, x in d.items()}, flush=True)
                save_json(name, res)
                del r
            if "rounds" in args.parts and 1 in ar:
                for S, K, N in ((3, 1, 4), (5, 8, 16)):
                    r = Runner(params, prompts(1), LONG,
                               spec=jspec.SpecConfig(num_steps=S, topk=K, num_draft_tokens=N))
                    per, _, _ = r.per_round(SHORT, LONG)
                    row[f"round_S{S}_K{K}_N{N}{tag}"] = d = {"ms_per_round": per * 1e3, "ratio_to_ar_step": per / ar[1]}
                    print(f"n={n} round {v}", (S, K, N), {k: round(x, 4) for k, x in d.items()}, flush=True)
                    save_json(name, res)
                    del r
        dispatch.GPU_XLA_OPTIONS = {}
        save_json(name, res)
        del params
    print("saved", save_json(name, res))


if __name__ == "__main__":
    main()
