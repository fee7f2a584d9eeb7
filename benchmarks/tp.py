"""Several GPUs: a Llama target (and an EAGLE-3-shaped head) or a DeepSeek target (and its
MTP layer) split over n GPUs.

For each device count n (one process, one run): random bf16 weights made directly in
their split layout (`common.random_split_params`, `random_deepseek_split`; nothing is
assembled on one GPU), then
- decode: ms/step at --batches (default 1 and 32), context 1k, and bandwidth utilisation:
  the bytes a step reads (weights + KV cache, all devices together; DeepSeek: the weights
  but the routed experts, the experts the batch's tokens were sent to, the latent cache
  on every device) / step time / (n x one GPU's copy bandwidth);
- rounds: chain S=3 and tree (5,8,16) at batch 1 as a ratio to one AR step (DeepSeek: the
  MTP layer's chain S=3 and tree (3,2,4));
- allreduce: one all-reduce of a [B, D] activation (the two per layer: bf16 for Llama,
  float32 for DeepSeek's partial sums), timed as the mean of 64 chained in one program; a
  step has 2 L + 1 of them (embedding included). DeepSeek also times the alternative to
  its expert parallelism's all-reduce: the two all-to-alls of [B k / n, D] bf16 rows a
  device (dispatch and combine) that splitting tokens over devices would need;
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

DeepSeek: --shape v2lite (V2-Lite, 27 layers), v3 (V3's layer shape, --layers of them:
first_k_dense_replace 0, so every layer is MoE; 22.5 GB of experts a layer), dstiny (CPU).

Run: PYTHONPATH=. python3 benchmarks/tp.py --shape 8b|70b|v2lite|v3 --devices 0,1,2 [--layers L]
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
from benchmarks.common import (CTX, LLAMA31_8B, LLAMA31_70B, LONG, SHORT, V2_LITE, V3_LAYER, Runner,  # noqa: E402
                               ceiling_of, copy_bandwidth, env_info, kv_bytes, prompts, random_split_params,
                               save_json, tagged, tunings, weight_bytes)
from benchmarks.deepseek import step_bytes  # noqa: E402
from jspec import sharding  # noqa: E402
from jspec.drafts.mtp import layer_config  # noqa: E402
from jspec.models import family_for  # noqa: E402
from jspec.models.deepseek_hf import DeepseekConfig  # noqa: E402

TINY = dataclasses.replace(LLAMA31_8B, vocab_size=128256, hidden_size=256, intermediate_size=512, num_layers=4,
                           num_heads=8, num_kv_heads=2, head_dim=32, sliding_windows=(0,) * 4)  # a CPU smoke test
DS_TINY = dataclasses.replace(V2_LITE, vocab_size=1024, hidden_size=128, intermediate_size=256, num_layers=3,
                              num_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                              moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2)  # CPU smoke test
SHAPES = {"8b": LLAMA31_8B, "70b": LLAMA31_70B, "tiny": TINY, "v2lite": V2_LITE, "v3": V3_LAYER, "dstiny": DS_TINY}


def random_deepseek_split(cfg: DeepseekConfig, n: int, with_mtp: bool) -> jspec.Params:
    """A random DeepSeek target (with a random MTP layer) split over n devices: made under
    jit with `split_deepseek`'s layout and shardings as outputs, so each device makes only
    its block; n = 0: no mesh."""
    jax.config.update("jax_default_prng_impl", "rbg")
    mesh = sharding.make_mesh(n) if n else None

    def made(init, split, key):
        if mesh is None:
            return None, jax.jit(init)(key)
        specs = []
        def split_init(k):  # noqa: E306
            kind, w, s = split(init(k))
            specs.append((kind, s))
            return w
        jax.eval_shape(split_init, key)
        kind, s = specs[0]
        return kind, jax.jit(split_init, out_shardings=sharding.shardings(mesh, s))(key)
    family = family_for(cfg)
    split_cfg, w = made(lambda k: family.init_weights(cfg, k), lambda w: family.split(cfg, w, n), jax.random.key(0))
    params = jspec.Params(config=split_cfg or cfg, weights=w, mesh=mesh)
    if with_mtp:
        d = jspec.MtpDraft(layer_config(cfg))
        split_d, dw = made(lambda k: d.init(k, cfg.vocab_size), lambda w: d.split(w, n), jax.random.key(1))
        params = params.with_draft(jspec.DraftParams(split_d or d, dw))
    return params


def deepseek_read_bytes(params, batch: int, ctx: float, n: int) -> float:
    """Bytes a DeepSeek decode step reads on all devices together: `deepseek.step_bytes`
    (weights but the routed experts, the experts the batch's tokens were sent to, the
    latent cache), plus what every device but one reads again: the replicated weights
    (latent projections, router, norms) and the latent cache."""
    c = params.config
    copies = max(n, 1) - 1
    replicated = sum(x.nbytes for x in jax.tree.leaves(params.weights["params"])
                     if n and not any(getattr(x.sharding, "spec", ())))
    latent = batch * ctx * (c.kv_lora_rank + c.qk_rope_head_dim) * 2 * c.num_layers
    return step_bytes(params, batch, batch, ctx) + copies * (replicated + latent)


def per_call_us(f, x, reps: int) -> float:
    """Microseconds a call of `reps` chained collectives takes per collective (median of 10)."""
    ts = []
    for _ in range(10):
        t = time.perf_counter()
        jax.block_until_ready(f(x))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) / reps * 1e6


def alltoall_us(n: int, rows: int, D: int, reps: int = 64) -> float:
    """Mean time of an all-to-all pair (dispatch and combine) of `rows` [rows, D] bf16 rows
    a device over n devices (64 chained); checks that the pair returns every row."""
    mesh = sharding.make_mesh(n)
    rows = max(n, rows - rows % n)

    def body(x):
        def pair(_, y):
            y = jax.lax.all_to_all(y, sharding.AXIS, 0, 0, tiled=True)
            return jax.lax.all_to_all(y, sharding.AXIS, 0, 0, tiled=True)
        return jax.lax.fori_loop(0, reps, pair, x)
    x = jax.device_put(jnp.arange(n * rows * D, dtype=jnp.float32).reshape(n * rows, D).astype(jnp.bfloat16),
                       NamedSharding(mesh, P(sharding.AXIS)))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(sharding.AXIS), out_specs=P(sharding.AXIS),
                              check_vma=False))
    if not np.array_equal(np.asarray(f(x), np.float32), np.asarray(x, np.float32)):
        raise AssertionError("all-to-all pair did not return the rows")
    return per_call_us(f, x, reps)


def allreduce_us(n: int, batch: int, D: int, options: dict, reps: int = 64, dtype=jnp.bfloat16) -> float:
    """Mean time of one all-reduce of [batch, D] (`dtype`) over n devices (64 chained),
    compiled with these XLA options; checks the sums."""
    mesh = sharding.make_mesh(n)

    def body(x):
        def one(_, y):
            return jax.lax.psum(y, sharding.AXIS) * (1.0 / n)
        return jax.lax.fori_loop(0, reps, one, x)
    x = jax.device_put(jnp.ones((n * batch, D), dtype), NamedSharding(mesh, P(sharding.AXIS)))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(sharding.AXIS), out_specs=P(sharding.AXIS),
                              check_vma=False)).lower(x).compile(options or None)
    x = x.at[0, 0].set(2.0)  # one value that a wrong reduction would change
    y = np.asarray(jax.block_until_ready(f(x)), np.float32)
    want = np.ones_like(y)
    want[::batch, 0] = (n + 1) / n  # every device's block gets the same sums
    if not np.allclose(y, want, rtol=1e-2):
        raise AssertionError(f"all-reduce with {options} gave wrong sums")
    return per_call_us(f, x, reps)


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
    deepseek = isinstance(cfg, DeepseekConfig)
    if args.layers:
        cfg = cfg.replace(num_layers=args.layers, **({} if deepseek else {"sliding_windows": (0,) * args.layers}))
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
    seen, first_n_tokens = {}, {}  # tokens of the first device count, by batch
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
                        us = allreduce_us(n, batch, cfg.hidden_size, options, dtype=jnp.float32 if deepseek
                                          else jnp.bfloat16)
                    except Exception as e:  # noqa: BLE001  (an option this XLA does not take)
                        row[tagged(f"allreduce_b{batch}_error", tname, seen)] = repr(e)[:300]
                        print(f"n={n} all-reduce b{batch} {tname}: {e!r}"[:400], flush=True)
                        continue
                    per_step = us * (2 * cfg.num_layers + 1) / 1e3
                    row[tagged(f"allreduce_b{batch}_us", tname, seen)] = us
                    row[tagged(f"allreduce_per_step_b{batch}_ms", tname, seen)] = per_step
                    print(f"n={n} all-reduce b{batch} {tname}: {us:.1f} us, per step {per_step:.3f} ms", flush=True)
                    if deepseek and tname == "default":
                        a2a = alltoall_us(n, -(-batch * cfg.num_experts_per_tok // n), cfg.hidden_size)
                        row[f"alltoall_pair_b{batch}_us"] = a2a
                        print(f"n={n} all-to-all pair b{batch}: {a2a:.1f} us", flush=True)
            save_json(name, res)
        if not batches:
            continue
        t0 = time.perf_counter()
        params = (random_deepseek_split if deepseek else random_split_params)(cfg, n, "rounds" in args.parts)
        wb = weight_bytes(params)
        row.update(weight_bytes=wb, init_s=time.perf_counter() - t0)
        print(f"n={n}: weights ready in {row['init_s']:.1f}s, {wb / 1e9:.2f} GB read per step", flush=True)
        first_tokens = {}
        target = dataclasses.replace(params, draft=None)
        for tname, tuning in tuned:
            ar = {}
            for batch in batches:
                try:
                    r = Runner(target, prompts(batch, cfg.vocab_size), LONG, tuning=tuning)
                    per, _, _ = r.per_round(SHORT, LONG)
                    tokens = r.run(SHORT)[1].tokens
                except Exception as e:  # noqa: BLE001
                    row[tagged(f"decode_b{batch}_error", tname, seen)] = repr(e)[:300]
                    print(f"n={n} decode b{batch} {tname}: {e!r}"[:400], flush=True)
                    continue
                first_tokens.setdefault(batch, tokens)
                first_n_tokens.setdefault((tname, batch), tokens)
                ar[batch] = per
                ctx = CTX + (SHORT + LONG) / 2
                if deepseek:
                    read = deepseek_read_bytes(params, batch, ctx, n)
                else:
                    read = wb + kv_bytes(params.config, batch, ctx)
                row[tagged(f"decode_b{batch}", tname, seen)] = d = {
                    "ms_per_step": per * 1e3, "ms_per_token": per * 1e3 / batch,
                    "bandwidth_util": read / per / (max(n, 1) * one_gpu), "compile_s": r.compile_s,
                    "tokens_equal_first_tuning": tokens == first_tokens[batch],
                    "tokens_equal_first_devices": tokens == first_n_tokens[tname, batch]}
                print(f"n={n} decode b{batch} {tname}", {k: round(x, 4) for k, x in d.items()}, flush=True)
                save_json(name, res)
                del r
            if "rounds" in args.parts and 1 in ar:
                for S, K, N in ((3, 1, 4), (3, 2, 4)) if deepseek else ((3, 1, 4), (5, 8, 16)):
                    r = Runner(params, prompts(1, cfg.vocab_size), LONG,
                               spec=jspec.SpecConfig(num_steps=S, topk=K, num_draft_tokens=N), tuning=tuning)
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
