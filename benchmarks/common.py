"""Shared benchmark helpers: model shapes, prompts, timing, the copy ceiling, random
models (whole or split over GPUs), profiler traces, named tunings and the Runner.

Every benchmark imports this module; a few also take a piece of another benchmark, none of
which imports them back (bitwise.py: bundle_eval.py's prompts and serve_engine.py's tiny
Llama; profiler.py: tp.py's split DeepSeek; tp.py: deepseek.py's bytes a step), so there
are no import cycles.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import glob
import itertools
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec import sharding
from jspec.cache.kv import stored
from jspec.config import ModelConfig, RopeConfig
from jspec.models import family_for
from jspec.models.deepseek_hf import DeepseekConfig
from jspec.models.llama import TP_SPLITS, UNEVEN_REPLICATED, kv_groups
from jspec.models.qwen3_next_hf import HybridConfig

# --------------------------------------------------------------------------- shapes

LLAMA31_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                         num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                         rope=RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 8192), dtype="bfloat16",
                         max_position_embeddings=131072)
LLAMA31_70B = dataclasses.replace(LLAMA31_8B, hidden_size=8192, intermediate_size=28672, num_layers=80,
                                  num_heads=64, num_kv_heads=8, sliding_windows=(0,) * 80)
YARN = RopeConfig(10000.0, "yarn", 40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                  mscale=0.707, mscale_all_dim=0.707)
V2_LITE = DeepseekConfig(
    vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_layers=27, num_heads=16, kv_lora_rank=512,
    q_lora_rank=0, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, moe_intermediate_size=1408,
    n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, scoring="softmax",
    topk_method="greedy", norm_topk_prob=False, rope=YARN, max_position_embeddings=163840, dtype="bfloat16",
    model_type="deepseek_v2", architecture="DeepseekV2ForCausalLM")
V3_LAYER = DeepseekConfig(  # DeepSeek-V3's layer shape; benchmarks take 1-3 of its MoE layers
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_layers=3, num_heads=128, kv_lora_rank=512,
    q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, moe_intermediate_size=2048,
    n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=0, n_group=8,
    topk_group=4, routed_scaling_factor=2.5, rope=YARN, max_position_embeddings=163840, dtype="bfloat16")
V32_LAYER = V3_LAYER.replace(  # DeepSeek-V3.2's: V3's with the sparse attention's indexer
    index_topk=2048, index_head_dim=128, index_n_heads=64, model_type="deepseek_v32",
    architecture="DeepseekV32ForCausalLM")
V32_TINY = V32_LAYER.replace(  # a tiny V3.2 in float32 (CPU runs)
    vocab_size=256, hidden_size=64, intermediate_size=96, num_heads=4, kv_lora_rank=32, q_lora_rank=48,
    qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, moe_intermediate_size=32, n_routed_experts=8,
    num_experts_per_tok=2, n_group=2, topk_group=1, index_topk=64, index_head_dim=16, index_n_heads=8, dtype="float32")

def hybrid_types(n: int) -> tuple[str, ...]:
    return tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n))


# Qwen/Qwen3.5-27B and Qwen3.5-35B-A3B's text models (their config.json's text_config)
QWEN35_27B = HybridConfig(
    vocab_size=248320, hidden_size=5120, num_layers=64, layer_types=hybrid_types(64), num_heads=24, num_kv_heads=4,
    head_dim=256, rotary_dim=64, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
    linear_value_head_dim=128, intermediate_size=17408, rope=RopeConfig(10000000.0), max_position_embeddings=262144,
    dtype="bfloat16", variant="qwen3_5", architecture="Qwen3_5ForConditionalGeneration", mtp_num_layers=1)
QWEN35_35B_A3B = dataclasses.replace(
    QWEN35_27B, hidden_size=2048, num_layers=40, layer_types=hybrid_types(40), num_heads=16, num_kv_heads=2,
    linear_num_value_heads=32, intermediate_size=0, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, variant="qwen3_5_moe", architecture="Qwen3_5MoeForConditionalGeneration")
# Qwen3.5-122B-A10B's text model: 48 layers of width 3072, 32 heads (2 KV heads of 256), 256
# experts of 1024 (8 a token) and a shared expert of 1024 in every layer; its linear layers
# as the family's larger models have them (16 key and 64 value heads of 128)
QWEN35_122B_A10B = dataclasses.replace(
    QWEN35_35B_A3B, hidden_size=3072, num_layers=48, layer_types=hybrid_types(48), num_heads=32, num_kv_heads=2,
    linear_num_value_heads=64, moe_intermediate_size=1024, shared_expert_intermediate_size=1024)

CTX, SHORT, LONG = 1024, 16, 144  # prompt tokens; the two run lengths whose difference gives a step


def prompts(batch: int, vocab: int = 100000, ctx: int = CTX, seed: int = 0) -> list[list[int]]:
    """`batch` random prompts of `ctx` token ids in [1, vocab)."""
    rng = np.random.RandomState(seed)
    return [rng.randint(1, vocab, size=ctx).tolist() for _ in range(batch)]


def weight_bytes(params) -> int:
    """Bytes of every weight a step reads: all but the embedding table (B rows of it)."""
    w = params.weights["params"]
    return sum(x.nbytes for x in jax.tree.leaves(w)) - w["embed_tokens"]["embedding"].nbytes


def kv_bytes(cfg, batch: int, ctx: float) -> float:
    """Bytes of a GQA KV cache of `ctx` slots a row (bf16)."""
    return 2 * cfg.num_layers * batch * ctx * cfg.num_kv_heads * cfg.head_dim * 2


def filled_state(params, batch: int, ctx: int, rounds: int, spec=None, seed: int = 0, kv_dtype: str | None = None):
    """(plan, weights, a loop state whose rows have committed `ctx` random slots, in the
    target's cache and the draft's), the dense cache sized for `ctx` plus `rounds` rounds,
    its keys and values in kv_dtype (`CacheConfig.dtype`; None: the model's)."""
    from jspec import requests as rq
    from jspec.loop import programs
    from jspec.loop.plan import make_plan
    prompt = [[1 + i for i in range(16)]] * batch
    reqs = rq.check_requests(params, prompt, ctx + 8 * rounds, [], {})
    cache = jspec.CacheConfig("dense", max_len=ctx + 8 * rounds + 48, dtype=kv_dtype)
    plan = make_plan(params, reqs.lens, reqs.max_new, 0, False, cache, spec)
    tw, pw = params.weights, params.draft.weights if params.draft is not None else None
    st, _ = programs.start_jit(plan, tw, pw, *rq.pack(plan, reqs, cache))
    key = jax.random.key(seed)

    def fill(buf):
        nonlocal key
        key, k = jax.random.split(key)
        return stored(jax.random.normal(k, buf.shape, jnp.float32) * 0.5, buf.dtype)
    st = st.replace(tcache=jax.tree.map(fill, st.tcache), L=jnp.full_like(st.L, ctx))
    if st.proposal is not None:
        st = st.replace(proposal=st.proposal.replace(cache=jax.tree.map(fill, st.proposal.cache)))
    return plan, (tw, pw), st


def step_times(params, batch: int, ctxs, rounds: int, spec=None, kv_dtype: str | None = None) -> dict[int, float]:
    """Seconds a round (a step when spec is None) with each context of `ctxs` committed,
    every context through ONE program whose cache holds the longest (as a server compiled
    for that length runs them): each from a fresh copy of the filled state. kv_dtype: the
    cache's (`filled_state`)."""
    from jspec.loop import programs
    plan, (tw, pw), filled = filled_state(params, batch, max(ctxs), rounds, spec, kv_dtype=kv_dtype)
    run = jax.jit(lambda tw, pw, st, n: programs.advance_fn(plan, tw, pw, st, st.step + n), donate_argnums=2)
    out = {}
    for ctx in ctxs:
        st = jax.tree.map(jnp.copy, filled).replace(L=jnp.full_like(filled.L, ctx))
        for _ in range(2):  # compile (the first context) and warm: the first timed run of a program
            st, back = run(tw, pw, st, 1)  # right after its first ran 16-20x slow on an H200 (2026-12-01)
        jax.block_until_ready(back)
        t0 = time.perf_counter()
        st, back = run(tw, pw, st, rounds)
        steps = int(jax.device_get(back["step"])) - 2
        out[ctx] = (time.perf_counter() - t0) / max(steps, 1)
        del st
    return out


def step_time(params, batch: int, ctx: int, rounds: int, spec=None) -> float:
    """Seconds a round (a step when spec is None) at one context (`step_times`)."""
    return step_times(params, batch, [ctx], rounds, spec)[ctx]


def prefill_flops(cfg, T: int) -> float:
    """Model FLOPs of one causal prefill of T tokens: 2 a weight a token for every product
    (MoE: the experts a token uses, the router included), attention's two products over
    T / 2 keys on average (MLA in the non-absorbed form, heads of Dn + Dr and Dv; gated
    delta layers: their state products, 4 Dk Dv a value head a token), and the LM head of
    one position."""
    D, L = cfg.hidden_size, cfg.num_layers
    pairs = T * T / 2  # (query, key) pairs of a causal prompt
    if isinstance(cfg, DeepseekConfig):
        H, Dn, Dr, Dv, Dc, Q = (cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                                cfg.kv_lora_rank, cfg.q_lora_rank)
        attn = (D * Q + Q * H * (Dn + Dr) if Q else D * H * (Dn + Dr)) + D * (Dc + Dr) + Dc * H * (Dn + Dv) + H * Dv * D
        dense = cfg.first_k_dense_replace
        moe = 3 * D * cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts) \
            + D * cfg.n_routed_experts
        weights = L * attn + dense * 3 * D * cfg.intermediate_size + (L - dense) * moe
        scores = L * 2 * H * (Dn + Dr + Dv) * pairs
    elif isinstance(cfg, HybridConfig):
        full = sum(t == "full_attention" for t in cfg.layer_types)
        H, Hkv, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        Hk, Hv, Dk, Dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                          cfg.linear_value_head_dim)
        attn = 2 * D * H * Dh + 2 * D * Hkv * Dh + H * Dh * D  # q with its output gate
        linear = D * (2 * Hk * Dk + 2 * Hv * Dv + 2 * Hv) + Hv * Dv * D  # q k v z, b a; out
        if cfg.num_experts:
            mlp = (3 * D * cfg.moe_intermediate_size * cfg.num_experts_per_tok
                   + 3 * D * cfg.shared_expert_intermediate_size + D * cfg.num_experts)
        else:
            mlp = 3 * D * cfg.intermediate_size
        weights = full * attn + (L - full) * linear + L * mlp
        scores = full * 4 * H * Dh * pairs + (L - full) * 4 * Hv * Dk * Dv * T / 2
    else:
        H, Hkv, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        weights = L * (D * (H + 2 * Hkv) * Dh + H * Dh * D + 3 * D * cfg.intermediate_size)
        scores = L * 4 * H * Dh * pairs
    return 2.0 * weights * T + scores + 2.0 * D * cfg.vocab_size


def matmul_rate() -> float:
    """bf16 FLOP/s of an 8192^3 product (XLA's GEMM), best of several calls."""
    a = jax.random.normal(jax.random.key(0), (8192, 8192), jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    per, _ = best_call_time(f, a, a, calls=20)
    return 2 * 8192 ** 3 / per


def prefill_rows(target, lengths, *, setting: str = "dense", tuning=None, reps=None, rate=None,
                 vocab: int = 100000, log=print, max_len: int | None = None) -> dict:
    """One prompt of each length (random ids, the same for a length in every setting)
    through `jspec.compile(...).run` with max_new_tokens=1: every length through ONE
    program compiled for `CacheConfig(setting, max_len=longest + 64)` (or `max_len`, named
    in the rows' label), so prompts prefill in blocks of `Tuning.prefill_block`. reps: {T:
    timed runs after a warm one} (default 3). -> {"<setting>_compile_s", "<setting>_plan", "<setting>_<T>": {seconds (median),
    tokens_per_s, mfu (against rate, when given), first_token}}."""
    reps = reps or {}
    rng = np.random.default_rng(0)
    cache = jspec.CacheConfig(setting, max_len=max_len or max(lengths) + 64)
    t0 = time.perf_counter()
    prog = jspec.compile(target, rng.integers(1, vocab, 100).tolist(), max_new_tokens=1, cache=cache,
                         **({"tuning": tuning} if tuning is not None else {}))
    label = setting if tuning is None else f"{setting}_{tuning_label(tuning)}"
    label += f"_len{max_len}" if max_len else ""
    out = {f"{label}_compile_s": time.perf_counter() - t0,
           f"{label}_plan": {"prompt_len": prog.plan.prompt_len, "prefill_chunk": prog.plan.prefill_chunk}}
    log(label, "compiled", out)
    for T in lengths:
        prompt = np.random.default_rng(T).integers(1, vocab, T).tolist()
        first = prog.run(prompt, max_new_tokens=1)
        times = []
        for _ in range(reps.get(T, 3)):
            t = time.perf_counter()
            prog.run(prompt, max_new_tokens=1)
            times.append(time.perf_counter() - t)
        sec = float(np.median(times))
        row = {"setting": label, "T": T, "seconds": sec, "first_token": first.tokens[0], "tokens_per_s": T / sec}
        if rate:
            row["mfu"] = prefill_flops(target.config, T) / sec / rate
        out[f"{label}_{T}"] = row
        log("prefill", rounded(row))
    return out


def tuning_label(tuning) -> str:
    """A short name for a tuning's prompt-block settings (the prefill rows' keys)."""
    names = []
    if not tuning.attention.fused_prompt_blocks:
        names.append("kernel_blocks")
    if not tuning.mla_decode.expanded_prompt_blocks:
        names.append("absorbed_blocks")
    if tuning.prefill_block != jspec.Tuning().prefill_block:
        names.append(f"block{tuning.prefill_block}")
    return "_".join(names) or "default"


def transformers_prefill_rows(model, lengths, vocab: int = 100000, log=print) -> dict:
    """transformers' one prefill forward of each length (its own attention, logits of the
    last position only, no cache): {"T<T>": {seconds (median of 3 after a warm run),
    tokens_per_s} or {failed: why}}."""
    import torch
    out = {}
    for T in lengths:
        ids = torch.tensor([np.random.default_rng(T).integers(1, vocab, T).tolist()], device="cuda")

        def run():
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.no_grad():
                model(ids, logits_to_keep=1, use_cache=False)
            torch.cuda.synchronize()
            return time.perf_counter() - t
        try:
            run()
            sec = float(np.median([run() for _ in range(3)]))
            row = {"T": T, "seconds": sec, "tokens_per_s": T / sec}
        except torch.OutOfMemoryError as e:
            row = {"T": T, "failed": f"out of memory: {str(e)[:200]}"}
        torch.cuda.empty_cache()
        out[f"T{T}"] = row
        log("transformers prefill", row)
    return out


def prefill_bench(cfg, name: str, lengths, tunings=(None,), reps=None, settings=("dense",),
                  max_len: int | None = None, fp8: bool = False) -> dict:
    """`prefill_rows` of a random model of shape cfg for each cache setting under each
    tuning (None: the defaults), the bf16 matmul rate measured first for the MFU; with fp8
    the same rows again over the weights rounded to FP8 and kept so
    (`quantization.quantize_params`), labelled `fp8_<setting>`; saved to $OUT/name."""
    res = {"env": env_info(), "lengths": list(lengths), "block": jspec.Tuning().prefill_block}
    rate = matmul_rate()
    res["matmul_tflops"] = rate / 1e12
    print(res, flush=True)
    t0 = time.perf_counter()
    targets = [("", random_params(cfg))]
    if fp8:
        from jspec.quantization import quantize_params
        targets.append(("fp8_", quantize_params(targets[0][1])))
    print(f"weights ready in {time.perf_counter() - t0:.1f}s", flush=True)
    for (prefix, target), setting, tuning in itertools.product(targets, settings, tunings):
        try:
            rows = prefill_rows(target, lengths, setting=setting, tuning=tuning, reps=reps, rate=rate,
                                vocab=min(cfg.vocab_size, 100000), log=lambda *a: print(prefix, *a, flush=True),
                                max_len=max_len)
            res.update({prefix + k: v for k, v in rows.items()})
        except Exception as e:  # noqa: BLE001 - a setting that fails is a result; the next one still runs
            label = prefix + setting + ("" if tuning is None else "_" + tuning_label(tuning))
            res[f"{label}_failed"] = f"{type(e).__name__}: {str(e)[:500]}"
            print(label, "failed:", res[f"{label}_failed"], flush=True)
        save_json(name, res)
    return res


def transformers_prefill_bench(cfg, name: str, lengths) -> dict:
    """`transformers_prefill_rows` of a random transformers model of shape cfg; saved to $OUT/name."""
    import torch
    import transformers
    res = {"env": env_info(), "torch": torch.__version__, "transformers": transformers.__version__}
    t0 = time.perf_counter()
    model = transformers_model(cfg)
    print(f"transformers model ready in {time.perf_counter() - t0:.1f}s", flush=True)
    res.update(transformers_prefill_rows(model, lengths, vocab=min(cfg.vocab_size, 100000),
                                         log=lambda *a: print(*a, flush=True)))
    save_json(name, res)
    return res


def transformers_model(cfg, device: str = "cuda"):
    """A random transformers model of one of the shapes above (bf16, sdpa) on `device`."""
    import torch
    import transformers
    if isinstance(cfg, DeepseekConfig):
        hf = transformers.DeepseekV2Config(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            moe_intermediate_size=cfg.moe_intermediate_size, num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
            n_shared_experts=cfg.n_shared_experts, n_routed_experts=cfg.n_routed_experts,
            num_experts_per_tok=cfg.num_experts_per_tok, first_k_dense_replace=cfg.first_k_dense_replace,
            kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank or None,
            qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim, topk_method=cfg.topk_method, norm_topk_prob=cfg.norm_topk_prob,
            max_position_embeddings=cfg.max_position_embeddings, attn_implementation="sdpa")
        cls = transformers.DeepseekV2ForCausalLM
    elif isinstance(cfg, HybridConfig):
        hf = transformers.Qwen3_5TextConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers, layer_types=list(cfg.layer_types), num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            linear_num_key_heads=cfg.linear_num_key_heads, linear_num_value_heads=cfg.linear_num_value_heads,
            linear_key_head_dim=cfg.linear_key_head_dim, linear_value_head_dim=cfg.linear_value_head_dim,
            max_position_embeddings=cfg.max_position_embeddings, attn_implementation="sdpa")
        cls = transformers.Qwen3_5ForCausalLM
    else:
        hf = transformers.LlamaConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads, rms_norm_eps=cfg.rms_norm_eps,
            max_position_embeddings=cfg.max_position_embeddings + 1024, rope_theta=cfg.rope.theta,
            bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        return cls(hf).eval()


def device_memory() -> int:
    """Bytes of memory the first device may use (0 where the backend does not say)."""
    try:
        return int((jax.devices()[0].memory_stats() or {}).get("bytes_limit", 0))
    except Exception:  # noqa: BLE001  (backends without memory_stats)
        return 0


# --------------------------------------------------------------------------- files

def out_dir() -> str:
    d = os.environ.get("OUT", "/tmp/jspec-bench")
    os.makedirs(d, exist_ok=True)
    return d


def save_json(name: str, obj):
    path = os.path.join(out_dir(), name)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    return path


def env_info() -> dict:
    dev = jax.devices()[0]
    return {"jax": jax.__version__, "device": getattr(dev, "device_kind", str(dev)), "backend": jax.default_backend(),
            "devices": len(jax.devices()), "date": time.strftime("%Y-%m-%d")}


def bench_tag(shape: str = "") -> str:
    """JSPEC_BENCH_TAG joined with the S,K,N shape (as SxKxN), for result file names."""
    return "_".join(x for x in (os.environ.get("JSPEC_BENCH_TAG", ""), shape.replace(",", "x")) if x)


# --------------------------------------------------------------------------- timing

def copy_bandwidth(nbytes: int = 2 << 30) -> dict:
    """Device-to-device copy bandwidth (bytes read + written per second), several ways."""
    out = {}
    try:
        import cupy as cp
        a = cp.ones(nbytes // 2, dtype=cp.float16)
        b = cp.empty_like(a)
        for _ in range(3):
            cp.cuda.runtime.memcpy(b.data.ptr, a.data.ptr, a.nbytes, cp.cuda.runtime.memcpyDeviceToDevice)
        cp.cuda.runtime.deviceSynchronize()
        ts = []
        for _ in range(10):
            t = time.perf_counter()
            cp.cuda.runtime.memcpy(b.data.ptr, a.data.ptr, a.nbytes, cp.cuda.runtime.memcpyDeviceToDevice)
            cp.cuda.runtime.deviceSynchronize()
            ts.append(time.perf_counter() - t)
        out["cudaMemcpy_d2d"] = 2 * a.nbytes / float(np.median(ts))
        del a, b
        cp.get_default_memory_pool().free_all_blocks()
    except Exception as e:  # noqa: BLE001
        out["cudaMemcpy_d2d_error"] = repr(e)[:200]
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a * 1.5)
    out["xla_elementwise"] = 2 * x.nbytes / median_time(f, x)
    return out


def ceiling_of(bw: dict) -> float:
    """The copy ceiling of a `copy_bandwidth` result: cudaMemcpy's where CuPy ran."""
    return bw.get("cudaMemcpy_d2d", bw["xla_elementwise"])


def median_time(f, *args, n: int = 10) -> float:
    """Median wall seconds of single calls (dispatch and sync included)."""
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def best_call_time(f, *args, calls: int = 50):
    """(seconds a call, the last output): `calls` calls issued back to back, best of 3."""
    out = jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(calls):
            out = f(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t) / calls)
    return best, out


# --------------------------------------------------------------------------- profiler traces

def traced(fn):
    """(fn(), the trace directory) with fn run under the profiler."""
    d = tempfile.mkdtemp()
    jax.profiler.start_trace(d)
    try:
        out = jax.block_until_ready(fn())
    finally:
        jax.profiler.stop_trace()
    return out, d


def trace_events(trace_dir: str) -> dict:
    """GPU kernel events of a trace: {device plane: [(stream, kernel, start_ns, duration_ns)]}."""
    from jax.profiler import ProfileData
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    out = {}
    for plane in ProfileData.from_file(paths[0]).planes if paths else ():
        if not plane.name.startswith("/device:GPU"):
            continue
        out[plane.name] = [(line.name.split("(")[0].strip(), e.name, e.start_ns, e.duration_ns)
                           for line in plane.lines if "Stream" in line.name for e in line.events]
    return out


def kernel_stats(events) -> tuple[dict, list]:
    """[(stream, kernel, start_ns, duration_ns)] -> ({kernel: [calls, us]}, sorted [(start_ns, end_ns)])."""
    stats = collections.defaultdict(lambda: [0, 0.0])
    spans = []
    for _, name, start, dur in events:
        stats[name][0] += 1
        stats[name][1] += dur / 1e3
        spans.append((start, start + dur))
    return stats, sorted(spans)


def kernel_spans(trace_dir: str) -> tuple[dict, list]:
    """`kernel_stats` of every GPU's kernels in a trace."""
    return kernel_stats([e for evs in trace_events(trace_dir).values() for e in evs])


def busy_and_gaps(spans) -> tuple[float, list]:
    """Sorted kernel spans -> (us some kernel runs, [us of each idle stretch between kernels])."""
    busy, end, gaps = 0.0, None, []
    for a, b in spans:
        if end is not None and a > end:
            gaps.append((a - end) / 1e3)
        if end is None or a > end:
            busy, end = busy + b - a, b
        elif b > end:
            busy, end = busy + b - end, b
    return busy / 1e3, gaps


def kernel_time(f, arg_sets) -> float:
    """Seconds of GPU kernel time a call of f, from a profiler trace of one call per
    argument set (each set its own inputs: nothing comes from L2 that a cold call reads);
    0 off GPU (a trace holds no GPU kernels there)."""
    jax.block_until_ready(f(*arg_sets[0]))
    _, d = traced(lambda: [f(*a) for a in arg_sets])
    stats, _ = kernel_spans(d)
    return sum(us for _, us in stats.values()) / len(arg_sets) / 1e6


# --------------------------------------------------------------------------- random models

def random_params(cfg, seed: int = 0) -> jspec.Params:
    """Random weights made on one device: `random_copies_split` unsplit."""
    return random_copies_split(cfg, 1, seed=seed)


def random_copies_split(cfg, n: int, *, fp8: bool = False, draft=None, seed: int = 0) -> jspec.Params:
    """Random weights made on device (the fast 'rbg' generator) and split over n devices
    (n = 1: not split), never whole on one device. The family's own init runs on the first
    device over the fewest leading layers that hold one layer of every shape
    (`first_layers`: compiled over all of them it took 92 s for V2-Lite and 155 s for
    Qwen3.5-27B on an H200, its random code emitted again for every layer), with
    `draft(cfg)` (a DraftParams, or None); with fp8 they are rounded to FP8 there
    (`quantize_params`: the target's projections and experts, the draft as it is); then
    split by `jspec.shard`. Every later layer is a copy of the split first layer of its
    shape with each array's values rolled by a random offset of its own (`rolled_split`,
    one compile per layer shape): its values are the init's (norms stay ones), its memory
    its own, on its devices."""
    from jspec.quantization import quantize_params
    jax.config.update("jax_default_prng_impl", "rbg")
    small, firsts, kinds = first_layers(cfg)
    made = jax.jit(lambda key: family_for(small).init_weights(small, key))(jax.random.key(seed))
    params = jspec.Params(config=small, weights=made, draft=None if draft is None else draft(cfg))
    del made
    if fp8:
        params = dataclasses.replace(quantize_params(params), draft=params.draft)
    if n > 1:
        params = jspec.shard(params, n)
    template = params.weights["params"]
    weights = {name: w for name, w in template.items() if not name.startswith("layers_")}
    keys = jax.random.split(jax.random.key(seed + 1), cfg.num_layers)
    for i, kind in enumerate(kinds):
        first = template[f"layers_{firsts[kind]}"]
        weights[f"layers_{i}"] = first if i == firsts[kind] else rolled_split(first, keys[i])
    cut = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
           if getattr(cfg, f.name) != getattr(small, f.name)}  # the fields `first_layers` cut
    return dataclasses.replace(params, config=dataclasses.replace(params.config, **cut), weights={"params": weights})


def rolled_split(tree, key):
    """Each array of `tree` with its values rolled by a random offset of its own, along its
    first axis that every device holds whole: in place on its devices (nothing moves
    between them), and no flat index (an array of 2**31 values or more, a V3 layer's
    experts, would overflow int32)."""
    leaves, structure = jax.tree.flatten(tree)

    def whole_axis(x):  # the first axis no device holds a part of (0 if none)
        spec = tuple(x.sharding.spec) if isinstance(x.sharding, jax.sharding.NamedSharding) else ()
        return next((a for a in range(x.ndim) if a >= len(spec) or spec[a] is None), 0)
    axes = tuple(whole_axis(x) for x in leaves)
    out = _rolled_along(axes, tuple(x.sharding for x in leaves))(leaves, key)
    return structure.unflatten(out)


@functools.cache
def _rolled_along(axes: tuple, shardings: tuple):
    def roll(leaves, key):
        shifts = jax.random.randint(key, (len(leaves),), 0, 2 ** 30)
        return [jnp.roll(x, s % x.shape[a], axis=a) if x.ndim else x for x, s, a in zip(leaves, shifts, axes)]
    return jax.jit(roll, out_shardings=list(shardings))


def first_layers(cfg):
    """(cfg cut to the fewest leading layers that hold one layer of every shape, {shape
    kind: its first layer}, each layer's shape kind), the kinds told apart by the layers'
    array shapes and dtypes (dense or MoE, linear or full attention)."""
    shapes = jax.eval_shape(lambda k: family_for(cfg).init_weights(cfg, k), jax.random.key(0))["params"]
    kinds = [(jax.tree.structure(shapes[f"layers_{i}"]),
              tuple((x.shape, x.dtype) for x in jax.tree.leaves(shapes[f"layers_{i}"])))
             for i in range(cfg.num_layers)]
    firsts = {}
    for i, kind in enumerate(kinds):
        firsts.setdefault(kind, i)
    n = max(firsts.values()) + 1
    per_layer = {f.name: getattr(cfg, f.name)[:n] for f in dataclasses.fields(cfg)
                 if isinstance(getattr(cfg, f.name), tuple) and len(getattr(cfg, f.name)) == cfg.num_layers}
    if getattr(cfg, "mlp_only_layers", None):
        per_layer["mlp_only_layers"] = tuple(i for i in cfg.mlp_only_layers if i < n)
    return dataclasses.replace(cfg, num_layers=n, **per_layer), firsts, kinds


def eagle3_head(target: jspec.Params, draft_vocab: int = 32000, seed: int = 1) -> jspec.DraftParams:
    """A random one-layer EAGLE-3 head for `target` (features of layers 2, L/2 and L-3)."""
    tc = target.config
    m = tc.replace(num_layers=1, sliding_windows=(0,))
    n = tc.num_layers
    d = jspec.Eagle3Draft(m, target_hidden_size=tc.hidden_size, aux_layers=(2, n // 2, n - 3),
                          draft_vocab_size=draft_vocab)
    w = jax.jit(lambda k: d.init(k, tc.vocab_size))(jax.random.key(seed))
    return jspec.DraftParams(config=d, weights=w)


def dflash_drafter(target: jspec.Params, layers: int = 5, seed: int = 2) -> jspec.DraftParams:
    """A random DFlash block drafter of z-lab's shape for `target` (Qwen3 layers of the
    target's width and heads, its MLP width; the outputs of five target layers spread from
    1 to n-3, as z-lab's Qwen3-8B drafter reads 1, 9, 17, 25, 33 of 36; blocks of 16)."""
    from jspec.train.dflash import default_layer_ids
    tc = target.config
    m = tc.replace(num_layers=layers, sliding_windows=(0,) * layers, qk_norm=True, model_type="qwen3",
                   tie_word_embeddings=False)
    d = jspec.DFlashDraft(m, target_layer_ids=default_layer_ids(tc.num_layers), num_target_layers=tc.num_layers,
                          block_size=16, mask_token_id=tc.vocab_size - 1)
    w = jax.jit(lambda k: d.init(k, tc.vocab_size))(jax.random.key(seed))
    return jspec.DraftParams(config=d, weights=w)


def model_for(shape: str = ""):
    """The 8B-shaped target with random weights, and for shape "S,K,N" a random EAGLE-3-shaped
    head with the matching SpecConfig -> (params, spec or None)."""
    target = random_params(LLAMA31_8B)
    if not shape:
        return target, None
    S, K, N = map(int, shape.split(","))
    return target.with_draft(eagle3_head(target)), jspec.SpecConfig(num_steps=S, topk=K, num_draft_tokens=N)


def split_init(init, n: int, mesh, key):
    """Random weights made on their devices: init under jit with the split's out_shardings."""
    if mesh is None:
        return jax.jit(init)(key)
    specs = sharding.weight_specs(jax.eval_shape(init, key), n, TP_SPLITS, UNEVEN_REPLICATED)
    return jax.jit(init, out_shardings=sharding.shardings(mesh, specs))(key)


def random_split_params(cfg, n: int, with_head: bool) -> jspec.Params:
    """A random Llama target (with a random EAGLE-3-shaped head) split over n devices, each
    weight made in its split layout (nothing assembled on one GPU); n = 0: no mesh."""
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


# --------------------------------------------------------------------------- tunings

GRAPHS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"  # XLA's command-buffer kinds
ONE_SHOT = ("xla_gpu_unsupported_use_all_reduce_one_shot_kernel", True)  # all-reduces as XLA's one-shot kernel
SYNC = ("xla_gpu_disable_async_collectives", "ALLREDUCE")  # all-reduces on the compute stream

# Settings benchmarks compare, as data: name -> the `jspec.Tuning` fields that differ from
# the defaults (a kernel's tile group as a dict of its fields; `tuning_of` builds the
# Tuning). Names join with "+" ("no_graphs+grouped_off": both).
TUNINGS: dict[str, dict] = {
    "default": {},
    # the expert kernel (decode and verification's experts, `matvec`): Tuning.experts
    "splits_half": {"experts": {"target_programs": 264}},  # fewer K splits
    "splits2x": {"experts": {"target_programs": 1056}},  # more K splits
    "min2": {"experts": {"min_split_chunks": 2}},  # K splits of 2 chunks allowed
    "stages4": {"experts": {"num_stages": 4}},
    "bn64": {"experts": {"block_n": 64}},
    "down_bn128": {"experts": {"gated_block_n": 128}},  # one token's gated product 128 columns wide
    "first_bn128": {"experts": {"narrow_first_min_din": 1 << 30}},  # one token's first product 128 wide
    "xla_rows": {"experts": {"matvec_max_rows": 0}},  # one-row dense products as XLA's (padded) products
    "matvec4": {"experts": {"matvec_max_rows": 4}},  # `matvec` (and `mla_inputs`) for the verify's rows too
    "matvec_auto": {"experts": {"matvec_block_n": 128, "matvec_splits": None}},
    "mosaic_experts_off": {"experts": {"mosaic_pairs": 0}},  # FP8 experts through the Triton kernel, not Mosaic
    # the FP8 product kernel's one-row (CUDA-core) tiles: Tuning.fp8
    "fp8_vec128": {"fp8": {"vector_block_n": 128, "min_split_groups": 1}},
    "fp8_vec128_sg2": {"fp8": {"vector_block_n": 128}},
    # MLA: Tuning.mla_decode, Tuning.mla_output
    "rows64": {"mla_decode": {"small_rows_max": 0}},  # 64 query rows a program whatever the rows
    "out32": {"mla_output": {"block_n": 32}},
    "out64": {"mla_output": {"block_n": 64}},
    "out_warps8": {"mla_output": {"num_warps": 8}},
    "chunk128": {"mla_output": {"split_tile": 0}},  # the latent in 128-wide chunks whatever the splits
    # the grouped expert kernel (prefill, large batches): Tuning.grouped
    "grouped_off": {"grouped": {"kernel": False}},  # jax.lax.ragged_dot instead
    "few_pairs_ragged": {"grouped": {"min_pairs_per_expert": 4}},  # ragged_dot below 4 pairs an expert
    "w8a8_all_pairs": {"fp8_w8a8": {"min_pairs_per_expert": 1}},  # FP8 experts grouped through w8a8 at any count
    # prologue switches and padding rules
    "norm_outside": {"mlp_norm_in_kernel": False},  # DeepSeek's post-attention norm as XLA's kernels
    "cache_write_off": {"cache_write_in_kernel": False},  # the latent row written by XLA's update
    "one_row_xla": {"two_row_elements": (0, 0)},  # no one-row product padded to two rows
    "xla_cpu_products": {"cpu_matmul_max_rows": 0},  # XLA's CPU products instead of jspec's
    # the GQA attention kernel: Tuning.attention
    "attn_bk64": {"attention": {"block_k": 64}},
    "attn_programs128": {"attention": {"target_programs": 128}},
    "attn_rows32": {"attention": {"max_rows": 32}},  # a verification's query rows split over more programs
    "attn_rows16": {"attention": {"max_rows": 16}},
    "attn_warps4": {"attention": {"num_warps": 4}},
    # row-invariant numerics (issue 40): Tuning.row_invariant and its kernels' tiles
    "row_invariant": {"row_invariant": True},
    "row_invariant_off": {"row_invariant": False},  # "default" is the family's auto rule (on at batch 1 on an H100)
    "row_attn_bk64": {"row_attention": {"block_k": 64, "split_blocks": 4}},
    "row_attn_bk64_split8": {"row_attention": {"block_k": 64, "split_blocks": 8}},
    "row_attn_split8": {"row_attention": {"split_blocks": 8}},  # splits of 1024 positions
    "row_attn_split16": {"row_attention": {"split_blocks": 16}},  # 2048: one split up to 2048 slots
    "rm_bk128": {"row_matmul": {"block_k": 128}},
    "rm_stages4": {"row_matmul": {"num_stages": 4}},
    "rm_programs528": {"row_matmul": {"target_programs": 528}},
    "rm_bn64": {"row_matmul": {"block_n": 64}},
    "rm_narrow": {"row_matmul": {"wide_n": 1 << 30}},  # no wide tiles for gate/up and heads
    "rm_wide_warps4": {"row_matmul": {"wide_num_warps": 4}},  # the wide tiles' warps before 2026-11-27
    "norm_warps4": {"row_norm": {"num_warps": 4}},
    "norm_warps16": {"row_norm": {"num_warps": 16}},
    "row_attn_128x2": {"row_attention": {"split_blocks": 2}},  # splits of 256 positions
    "row_attn_64x2": {"row_attention": {"block_k": 64, "split_blocks": 2}},
    "row_attn_64x1": {"row_attention": {"block_k": 64, "split_blocks": 1}},
    "row_unpacked": {"row_attention": {"pack_tokens": False}},  # one token's heads a 16-row tile
    "row_pack_always": {"row_attention": {"pack_min_splits": 0}},  # packed tiles over short caches too
    "row_merge_loop": {"row_attention": {"unroll_splits": 0}},  # the split merge as a loop
    "row_mla_64x2": {"row_mla": {"block_k": 64, "split_blocks": 2}},  # Tuning.row_mla (DeepSeek)
    "row_mla_32x4": {"row_mla": {"block_k": 32, "split_blocks": 4}},
    "row_mla_32x2": {"row_mla": {"block_k": 32, "split_blocks": 2}},
    "row_mla_w8": {"row_mla": {"num_warps": 8}},
    "row_mla_64x1": {"row_mla": {"block_k": 64, "split_blocks": 1}},
    "row_mla_64x2_s3": {"row_mla": {"block_k": 64, "split_blocks": 2, "num_stages": 3}},
    # XLA options (on a GPU)
    "graphs_off": {"family_xla_options": False},  # XLA's default command buffers, not the family's
    "graphs_loop_only": {"family_xla_options": False, "xla_options": (("xla_gpu_enable_command_buffer", GRAPHS),)},
    "no_graphs": {"family_xla_options": False, "xla_options": (("xla_gpu_enable_command_buffer", ""),)},
    # the family's command buffers with the collectives (several GPUs' all-reduces) captured too
    "graphs_collectives": {"xla_options": (("xla_gpu_enable_command_buffer", GRAPHS + ",COLLECTIVES"),)},
    "ar_one_shot": {"xla_options": (ONE_SHOT,)},
    "ar_sync": {"xla_options": (SYNC,)},
    "ar_one_shot_sync": {"xla_options": (ONE_SHOT, SYNC)},
}


def tuning_of(name: str) -> jspec.Tuning:
    """The `jspec.Tuning` of a TUNINGS name ("a+b": both)."""
    fields: dict = {}
    for part in name.split("+"):
        if part not in TUNINGS:
            raise ValueError(f"unknown tuning {part!r}; known: {', '.join(TUNINGS)}")
        for k, v in TUNINGS[part].items():
            if isinstance(v, dict):
                fields[k] = {**fields.get(k, {}), **v}
            elif k == "xla_options":
                fields[k] = fields.get(k, ()) + v
            else:
                fields[k] = v
    base = jspec.Tuning()
    have = {f.name for f in dataclasses.fields(base)}
    if set(fields) - have:
        raise ValueError(f"tuning {name!r} sets {sorted(set(fields) - have)}, which this jspec's Tuning does not have")
    return dataclasses.replace(base, **{k: dataclasses.replace(getattr(base, k), **v) if isinstance(v, dict) else v
                                        for k, v in fields.items()})


def tunings(names: str) -> list[tuple[str, jspec.Tuning | None]]:
    """"a,b,a" -> [(name, Tuning)] in that order (repeats alternate the same settings);
    "default" gives None, which `Runner` does not pass on (so default rows also run on an
    older checkout of jspec, for side-by-side comparisons of two trees)."""
    return [(n, None if n == "default" else tuning_of(n)) for n in names.split(",") if n]


def tagged(key: str, name: str, seen: dict) -> str:
    """A result key for a row measured under tuning `name`: the key itself for the first
    default row, `key_name` for other tunings, `_2`, `_3`... on repeats."""
    seen[key, name] = seen.get((key, name), 0) + 1
    k = key if name == "default" else f"{key}_{name}"
    return k if seen[key, name] == 1 else f"{k}_{seen[key, name]}"


# --------------------------------------------------------------------------- the runner

class Runner:
    """Runs one compiled generation loop (`jspec.compile`) with chosen per-request limits,
    so that two lengths share one program and their time difference is per-round cost.
    tuning: a `jspec.Tuning` (or a TUNINGS name) the program is compiled with (None: the
    defaults; not passed to `jspec.compile` at all)."""

    def __init__(self, params, prompts, max_new: int, spec=None, cache=None, tuning=None, **sampling):
        if isinstance(tuning, str):
            tuning = tuning_of(tuning)
        if tuning is not None:
            sampling["tuning"] = tuning
        self.prog = jspec.compile(params, prompts, max_new_tokens=max_new, stop_token_ids=[], cache=cache, spec=spec,
                                  **sampling)
        self.compile_s = self.prog.compile_s
        self.plan = self.prog.plan

    def run(self, max_new: int, **sampling):
        """(seconds, GenerateOutput) of the compiled prompts with max_new_tokens=max_new
        (sampling values: as compiled, unless given)."""
        out = self.prog.run(max_new_tokens=max_new, **sampling)
        return out.timing["run_s"], out

    def per_round(self, short: int, long: int, reps: int = 3, **sampling):
        """(seconds per round, rounds, tokens) from the difference of two runs."""
        self.run(short, **sampling)
        best = None
        for _ in range(reps):
            ts, rs = self.run(short, **sampling)
            tl, rl = self.run(long, **sampling)
            rounds = max(rl.stats.rounds) - max(rs.stats.rounds)
            toks = rl.timing["new_tokens"] - rs.timing["new_tokens"]
            per = (tl - ts) / rounds
            if best is None or per < best[0]:
                best = (per, rounds, toks)
        return best


def program_temp_GB(prog) -> float | None:
    """GB of temporaries (XLA's memory analysis, on each device) of a compiled generation's
    program (`jspec.compile`) for its compiled requests; None where the backend gives none."""
    from jspec.loop import programs
    rows, adm = prog.device_inputs(prog.requests())
    analysis = prog.program(programs.generate_jit, rows, adm).memory_analysis()
    return None if analysis is None else analysis.temp_size_in_bytes / 1e9


def rounded(d: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}


def prompt_row(prog, prompts, new: int) -> dict:
    """A compiled jspec program over prompts one at a time (after a warm-up run), greedy,
    `new` tokens each, no stop tokens -> {tokens_per_s: median over prompts, tau: mean,
    tokens: per prompt}."""
    prog.run()  # warm up
    rates, toks, taus = [], [], []
    for p in prompts:
        out = prog.run(p, max_new_tokens=new, stop_token_ids=[])
        rates.append(len(out.tokens) / out.timing["run_s"])
        toks.append(out.tokens)
        taus.append(out.stats.mean_accept_length)
    return {"tokens_per_s": float(np.median(rates)), "tau": float(np.mean(taus)), "tokens": toks}


def transformers_row(model, prompts, new: int, **generate_kw) -> dict:
    """transformers' greedy `generate` on `model` over prompts one at a time (the first call
    warms up), exactly `new` tokens each -> {tokens_per_s: median over prompts, tokens}."""
    import torch
    dev = model.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rates, toks = [], []
    for i, p in enumerate([prompts[0]] + list(prompts)):
        ids = torch.tensor([p], device=dev)
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, **generate_kw)
        sync()
        if i:
            toks.append(out[0, len(p):].tolist())
            rates.append(len(toks[-1]) / (time.perf_counter() - t))
    return {"tokens_per_s": float(np.median(rates)), "tokens": toks}

