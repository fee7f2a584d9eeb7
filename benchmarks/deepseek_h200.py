"""DeepSeek benchmarks with random bf16 weights (H200): MLA + MoE decoding and MTP rounds.

Parts (arguments; default: all):
- decode: the DeepSeek-V2-Lite shape (27 layers, 15.7B parameters), context 1k, ms/token
  at batch 1 and 32, and bandwidth utilisation = bytes a step must read / step time /
  copy bandwidth. Bytes: every weight but the embedding table and the routed experts,
  plus the routed experts the batch's tokens were sent to (their expected number of
  distinct experts under uniform routing, which random weights give:
  E * (1 - (1 - k/E)^B) per MoE layer), plus the latent cache.
- mtp: a random MTP layer of the same shape as the draft; chain S = 1..3 and tree
  (3,2,4) rounds at batch 1 as ratios to one AR step, with the routed experts a verify
  of N tokens reads (expected distinct experts per MoE layer for N tokens).
- v3layer: the DeepSeek-V3 layer shape (hidden 7168, 128 heads, q_lora 1536, 256 experts,
  top-8, expert width 2048), models of 1 and 3 MoE layers; per-layer decode time at
  batch 1 (DEEPSEEK_V3_BATCH: another batch) = the difference / 2, and its bandwidth
  utilisation (the routed experts: their expected distinct number for the batch).

Run: PYTHONPATH=. python3 benchmarks/deepseek_h200.py [decode] [mtp] [v3layer]
(DEEPSEEK_BATCHES=1,32: the decode batches; mtp needs batch 1 first for its ratios;
DEEPSEEK_SETTING: one of `benchmarks/deepseek_ab.py`'s settings, default the code as it is;
DEEPSEEK_V3_SETTINGS=a,b: v3layer under each of these settings on the same weights;
DEEPSEEK_V3_BATCH: v3layer's batch, default 1;
DEEPSEEK_ROUNDS=SxKxN,...: the MTP rounds, default 1x1x2,2x1x3,3x1x4,3x2x4;
DEEPSEEK_MTP_SETTINGS=a,b: each round under each of these settings, same weights, and
whether its tokens equal the first setting's)
"""
from __future__ import annotations

import itertools
import os
import sys
import time

import jax
import numpy as np

import jspec
from benchmarks.common import Runner, copy_bandwidth, env_info, random_params, save_json
from jspec.config import RopeConfig
from jspec.drafts import MtpDraft
from jspec.drafts.mtp import layer_config
from jspec.models.deepseek_hf import DeepseekConfig

CTX, SHORT, LONG = 1024, 16, 112
YARN = RopeConfig(10000.0, "yarn", 40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                  mscale=0.707, mscale_all_dim=0.707)
V2_LITE = DeepseekConfig(
    vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_layers=27, num_heads=16, kv_lora_rank=512,
    q_lora_rank=0, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, moe_intermediate_size=1408,
    n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, scoring="softmax",
    topk_method="greedy", norm_topk_prob=False, rope=YARN, max_position_embeddings=163840, dtype="bfloat16",
    model_type="deepseek_v2", architecture="DeepseekV2ForCausalLM")
V3_LAYER = DeepseekConfig(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_layers=3, num_heads=128, kv_lora_rank=512,
    q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, moe_intermediate_size=2048,
    n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=0, n_group=8,
    topk_group=4, routed_scaling_factor=2.5, rope=YARN, max_position_embeddings=163840, dtype="bfloat16")


def prompts(batch: int, vocab: int, ctx: int = CTX, seed: int = 0):
    rng = np.random.RandomState(seed)
    return [rng.randint(1, vocab, size=ctx).tolist() for _ in range(batch)]


def expert_bytes(c: DeepseekConfig) -> int:
    return 3 * c.hidden_size * c.moe_intermediate_size * 2


def distinct_experts(c: DeepseekConfig, tokens: int) -> float:
    """Expected distinct experts of one MoE layer when `tokens` tokens each pick k of E uniformly."""
    E, k = c.n_routed_experts, c.num_experts_per_tok
    return E * (1 - (1 - k / E) ** tokens)


def fixed_bytes(params) -> int:
    """Weights every step reads: all but the embedding table and the routed experts."""
    w = params.weights["params"]
    total = sum(x.nbytes for x in jax.tree.leaves(w)) - w["embed_tokens"]["embedding"].nbytes
    return total - sum(x.nbytes for path, x in jax.tree_util.tree_leaves_with_path(w)
                       if any(getattr(p, "key", None) == "experts" for p in path))


def step_bytes(params, tokens: int, batch: int, ctx: float) -> float:
    c = params.config
    moe_layers = sum(c.is_moe(i) for i in range(c.num_layers))
    latent = batch * ctx * (c.kv_lora_rank + c.qk_rope_head_dim) * 2 * c.num_layers
    return fixed_bytes(params) + moe_layers * distinct_experts(c, tokens) * expert_bytes(c) + latent


def _row(d):
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}


def decode_and_mtp(parts, res, ceiling, name):
    from benchmarks.deepseek_ab import apply

    t0 = time.perf_counter()
    target = random_params(V2_LITE)
    n = sum(x.size for x in jax.tree.leaves(target.weights))
    print(f"V2-Lite shape ready in {time.perf_counter() - t0:.1f}s: {n / 1e9:.2f}B parameters", flush=True)
    res["v2lite_parameters"] = n
    ar = {}
    batches = tuple(int(b) for b in os.environ.get("DEEPSEEK_BATCHES", "1,32").split(","))
    for batch in (batches if "decode" in parts else (1,)):
        r = Runner(target, prompts(batch, V2_LITE.vocab_size), LONG)
        per, _, _ = r.per_round(SHORT, LONG, reps=2)
        ctx = CTX + (SHORT + LONG) / 2
        nbytes = step_bytes(target, batch, batch, ctx)
        ar[batch] = per
        row = {"batch": batch, "ms_per_step": per * 1e3, "ms_per_token": per * 1e3 / batch, "tokens_per_s": batch / per,
               "GB_read_per_step": nbytes / 1e9, "bandwidth_util": nbytes / per / ceiling, "compile_s": r.compile_s}
        res[f"v2lite_decode_b{batch}"] = row
        print("decode", _row(row), flush=True)
        save_json(name, res)
        del r
    if "mtp" in parts:
        draft = MtpDraft(layer_config(V2_LITE))
        dw = jax.jit(lambda k: draft.init(k, V2_LITE.vocab_size))(jax.random.key(1))
        spec_params = target.with_draft(jspec.DraftParams(draft, dw))
        rounds = os.environ.get("DEEPSEEK_ROUNDS", "1x1x2,2x1x3,3x1x4,3x2x4")
        settings = os.environ.get("DEEPSEEK_MTP_SETTINGS", "default").split(",")
        first_tokens = None
        for (S, K, N), setting in itertools.product((tuple(int(v) for v in r.split("x")) for r in rounds.split(",")),
                                                    settings):
            kept = apply(setting)
            jspec.clear_caches()
            r = Runner(spec_params, prompts(1, V2_LITE.vocab_size), LONG,
                       spec=jspec.SpecConfig(num_steps=S, topk=K, num_draft_tokens=N))
            per, _, _ = r.per_round(SHORT, LONG, reps=2)
            tokens = r.run(LONG)[1].tokens
            first_tokens = first_tokens if setting != settings[0] else tokens
            for m, const, value in kept:
                setattr(m, const, value)
            moe_layers = V2_LITE.num_layers - V2_LITE.first_k_dense_replace
            row = {"S": S, "K": K, "N": N, "ms_per_round": per * 1e3, "ratio_to_ar_step": per / ar[1],
                   "verify_experts_per_layer": distinct_experts(V2_LITE, N),
                   "verify_expert_GB": moe_layers * distinct_experts(V2_LITE, N) * expert_bytes(V2_LITE) / 1e9,
                   "draft_expert_GB_per_step": distinct_experts(V2_LITE, K) * expert_bytes(V2_LITE) / 1e9,
                   "compile_s": r.compile_s, "same_tokens_as_" + settings[0]: tokens == first_tokens}
            res[f"v2lite_mtp_S{S}_K{K}_N{N}" + ("" if setting == "default" else f"_{setting}")] = row
            print("mtp round", setting, _row(row), flush=True)
            save_json(name, res)
            del r


def v3_layers(res, ceiling, name):
    """Per-layer decode time of the V3 layer shape under each of DEEPSEEK_V3_SETTINGS
    (comma-separated `deepseek_ab` settings, default "default"), on the same weights."""
    from benchmarks.deepseek_ab import apply

    settings = os.environ.get("DEEPSEEK_V3_SETTINGS", "default").split(",")
    batch = int(os.environ.get("DEEPSEEK_V3_BATCH", "1"))
    tag = "" if batch == 1 else f"_b{batch}"
    times = {}
    for layers in (1, 3):
        cfg = V3_LAYER.replace(num_layers=layers)
        target = random_params(cfg)
        for setting in settings:
            kept = apply(setting)
            jspec.clear_caches()
            r = Runner(target, prompts(batch, cfg.vocab_size), LONG)
            per, _, _ = r.per_round(SHORT, LONG, reps=2)
            times[setting, layers] = per
            res[f"v3_{layers}layers{tag}_ms_per_step" + ("" if setting == "default" else f"_{setting}")] = per * 1e3
            print(f"V3 shape, {layers} layers, batch {batch}, {setting}: {per * 1e3:.3f} ms/step", flush=True)
            for m, const, value in kept:
                setattr(m, const, value)
            del r
        if layers == 3:
            w = target.weights["params"]["layers_1"]
            attn = sum(x.nbytes for x in jax.tree.leaves(w["self_attn"]))
            shared = sum(x.nbytes for x in jax.tree.leaves(w["mlp"]["shared_experts"]))
            router = sum(x.nbytes for x in jax.tree.leaves(w["mlp"]["router"]))
            latent = batch * (CTX + (SHORT + LONG) / 2) * 576 * 2
            nbytes = attn + shared + router + distinct_experts(cfg, batch) * expert_bytes(cfg) + latent
        del target
    for setting in settings:
        per_layer = (times[setting, 3] - times[setting, 1]) / 2
        row = {"ms_per_layer": per_layer * 1e3, "GB_per_layer": nbytes / 1e9,
               "bandwidth_util": nbytes / per_layer / ceiling}
        res[f"v3_layer_decode_b{batch}" + ("" if setting == "default" else f"_{setting}")] = row
        print(f"v3 layer, batch {batch}, {setting}", _row(row), flush=True)
    save_json(name, res)


def main(parts):
    from benchmarks.deepseek_ab import apply

    setting = os.environ.get("DEEPSEEK_SETTING", "default")
    apply(setting)
    name = "deepseek_h200.json" if setting == "default" else f"deepseek_h200_{setting}.json"
    res = {"env": env_info(), "kernels": os.environ.get("JSPEC_KERNELS", "auto"), "setting": setting}
    print(res["env"], flush=True)
    bw = copy_bandwidth()
    res["copy_bandwidth"] = bw
    ceiling = bw.get("cudaMemcpy_d2d", bw["xla_elementwise"])
    print("copy bandwidth TB/s", {k: round(v / 1e12, 3) for k, v in bw.items() if isinstance(v, float)}, flush=True)
    if parts & {"decode", "mtp"}:
        decode_and_mtp(parts, res, ceiling, name)
    if "v3layer" in parts:
        v3_layers(res, ceiling, name)
    print("saved", save_json(name, res))


if __name__ == "__main__":
    main(set(sys.argv[1:]) or {"decode", "mtp", "v3layer"})
