"""Qwen3-Next and Qwen3.5 (dense and MoE) checkpoints in Hugging Face's format: one
`HybridConfig` from config.json (a `Qwen3_5*ForConditionalGeneration` checkpoint's text
part under `text_config`), and weights in both directions.

Layers are `linear_attention` (Gated DeltaNet) or `full_attention` (gated attention), as
config.json's `layer_types` (or `full_attention_interval`) says. How the weights are kept:

- a linear layer's input projections are one matrix `in_proj` [D, Ch + Hv Dv + 2 Hv] whose
  columns are q (Hk Dk), k (Hk Dk), v (Hv Dv), then z (Hv Dv), b (Hv), a (Hv), each in head
  order: Qwen3.5's split `in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a` side by
  side, and Qwen3-Next's `in_proj_qkvz` / `in_proj_ba` (grouped per key head: [Hk, Dk | Dk
  | (Hv/Hk) Dv | (Hv/Hk) Dv] and [Hk, Hv/Hk | Hv/Hk]) reordered into it. The first
  Ch = 2 Hk Dk + Hv Dv columns are the convolution's channels in its own order.
- `conv_weight` [Ch, C] (conv1d.weight [Ch, 1, C] without its middle axis).
- a full-attention layer's q_proj (per head [query | gate]), k_proj and v_proj are one
  matrix `qkv_proj` [D, 2 H Dh + 2 Hkv Dh], in that order.
- MoE experts stacked per layer as `models.deepseek` keeps them ({"gate_up": [E, D, 2Fm],
  "down": [E, Fm, D]}), read from per-expert tensors or from transformers' fused
  `experts.gate_up_proj` [E, 2Fm, D] / `experts.down_proj` [E, D, Fm].
- norms keep Hugging Face's weights: (1 + w) norms (zero-initialised) everywhere except the
  gated norm of the linear layers (plain w).
- the multi-token-prediction layer (`mtp.*`) belongs to the MTP draft
  (`jspec.drafts.qwen_mtp`), not to the target.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from jspec.config import DTYPES, RopeConfig
from jspec.models.deepseek_hf import end_tensors
from jspec.models.deepseek_hf import mlp_params as dense_mlp_params
from jspec.models.deepseek_hf import mlp_tensors as dense_mlp_tensors
from jspec.models.llama_hf import rope_from_hf
from jspec.tensors import Tensors, hf_linear, kv_scale_tensors, to_numpy, unstacked_experts

# architectures entry -> (variant, text weights under model.language_model)
ARCHITECTURES = {
    "Qwen3NextForCausalLM": ("qwen3_next", False),
    "Qwen3_5ForCausalLM": ("qwen3_5", False),
    "Qwen3_5MoeForCausalLM": ("qwen3_5_moe", False),
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", True),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5_moe", True),
}
TARGET_ARCHITECTURES = tuple(ARCHITECTURES)
LINEAR, FULL = "linear_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """A Qwen3-Next / Qwen3.5 decoder. Letters: V vocab, D width; full attention H/Hkv
    heads of Dh (rotary_dim of them rotated); linear attention Hk key and Hv value heads of
    Dk and Dv, a conv of width C over Ch = 2 Hk Dk + Hv Dv channels; F the dense MLP width;
    E experts, k a token, Fm an expert's width, Fs the shared expert's."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int = 4
    intermediate_size: int = 0  # dense MLP width (layers without experts)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    mtp_num_layers: int = 0
    dtype: str = "float32"
    variant: str = "qwen3_5"  # qwen3_next | qwen3_5 | qwen3_5_moe
    architecture: str = "Qwen3_5ForCausalLM"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Several devices (`models.qwen3_next_split.split_qwen3_next`): the model split over
    # `devices`; `per_device`: this config is one device's block of it (`block`).
    devices: int = 1
    per_device: bool = False

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - {LINEAR, FULL}:
            raise ValueError(f"layer_types must name {LINEAR!r} or {FULL!r} for each of the {self.num_layers} "
                             f"layers, got {self.layer_types!r}")
        if self.num_heads % self.num_kv_heads or self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("attention heads must be a multiple of KV heads, linear value heads a multiple of "
                             "linear key heads")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]")

    @property
    def jnp_dtype(self):
        import jax.numpy as jnp
        return jnp.dtype(self.dtype)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Ch: the convolution's channels (q, k, v)."""
        return 2 * self.key_dim + self.value_dim

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    def is_moe(self, layer: int) -> bool:
        """Qwen3-Next's rule (Qwen3.5-MoE: every layer)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def replace(self, **kw) -> "HybridConfig":
        return dataclasses.replace(self, **kw)

    def block(self) -> "HybridConfig":
        """The config one device's layer code runs with when the model is split over
        `devices`: 1/n of the attention heads, KV heads, linear key and value heads, dense
        MLP and shared expert columns (its E/n routed experts follow from the arrays it
        holds; routing still chooses among all E); attention and MLP outputs are partial
        sums that the layer adds up over the devices."""
        n = self.devices
        return self.replace(num_heads=self.num_heads // n, num_kv_heads=self.num_kv_heads // n,
                            linear_num_key_heads=self.linear_num_key_heads // n,
                            linear_num_value_heads=self.linear_num_value_heads // n,
                            intermediate_size=self.intermediate_size // n,
                            shared_expert_intermediate_size=self.shared_expert_intermediate_size // n, per_device=True)


def text_config(cfg: Mapping[str, Any], where: str = "config.json") -> tuple[Mapping[str, Any], str, bool]:
    """config.json -> (the text model's fields, architecture, nested under language_model)."""
    arch = next((a for a in cfg.get("architectures") or [] if a in ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"{where}: architectures {cfg.get('architectures')!r} name no Qwen3-Next / Qwen3.5 model")
    nested = ARCHITECTURES[arch][1]
    if nested:
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"{where}: a {arch} config.json needs its text model's fields under text_config")
        return text, arch, True
    return cfg, arch, False


def config_from_hf(cfg: Mapping[str, Any], dtype: str | None = None, where: str = "config.json") -> HybridConfig:
    where = getattr(cfg, "path", where)  # `loading.ConfigJSON` knows its file
    text, arch, _ = text_config(cfg, where)
    variant = ARCHITECTURES[arch][0]

    def req(name):
        if text.get(name) is None:
            raise ValueError(f"{where}: lacks {name!r}")
        return text[name]

    act = text.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{where}: unsupported hidden_act {act!r} (jspec supports silu)")
    L = int(req("num_hidden_layers"))
    types = text.get("layer_types")
    if types is None:
        interval = int(text.get("full_attention_interval", 4))
        types = [LINEAR if (i + 1) % interval else FULL for i in range(L)]
    params = dict(text.get("rope_parameters") or {})
    partial = float(params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
    head_dim = int(text.get("head_dim") or int(req("hidden_size")) // int(req("num_attention_heads")))
    rope_src = dict(text)
    if params:  # mrope_section / mrope_interleaved: text positions are equal in every section
        rope_src["rope_parameters"] = {k: v for k, v in params.items()
                                       if k not in ("mrope_section", "mrope_interleaved", "partial_rotary_factor")}
    if dtype is None:
        dtype = text.get("dtype") or text.get("torch_dtype") or cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        dtype = dtype if dtype in DTYPES else "float32"
    eos = text.get("eos_token_id", cfg.get("eos_token_id"))
    eos = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []))
    experts = int(text.get("num_experts", 0) or 0) if variant != "qwen3_5" else 0
    tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    try:
        return HybridConfig(
            vocab_size=int(req("vocab_size")), hidden_size=int(req("hidden_size")), num_layers=L,
            layer_types=tuple(types), num_heads=int(req("num_attention_heads")),
            num_kv_heads=int(req("num_key_value_heads")), head_dim=head_dim, rotary_dim=int(head_dim * partial),
            linear_num_key_heads=int(req("linear_num_key_heads")),
            linear_num_value_heads=int(req("linear_num_value_heads")),
            linear_key_head_dim=int(req("linear_key_head_dim")), linear_value_head_dim=int(req("linear_value_head_dim")),
            conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
            intermediate_size=int(text.get("intermediate_size", 0) or 0), num_experts=experts,
            num_experts_per_tok=int(text.get("num_experts_per_tok", 0) or 0) if experts else 0,
            moe_intermediate_size=int(text.get("moe_intermediate_size", 0) or 0) if experts else 0,
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size", 0) or 0) if experts else 0,
            norm_topk_prob=bool(text.get("norm_topk_prob", True)) if variant == "qwen3_next" else True,
            decoder_sparse_step=int(text.get("decoder_sparse_step", 1) or 1) if variant == "qwen3_next" else 1,
            mlp_only_layers=tuple(text.get("mlp_only_layers") or ()) if variant == "qwen3_next" else (),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)), rope=rope_from_hf(rope_src),
            attention_bias=bool(text.get("attention_bias", False)),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)), tie_word_embeddings=bool(tie),
            mtp_num_layers=int(text.get("mtp_num_hidden_layers", cfg.get("num_nextn_predict_layers", 0)) or 0),
            dtype=dtype, variant=variant, architecture=arch,
            bos_token_id=text.get("bos_token_id", cfg.get("bos_token_id")), eos_token_ids=eos)
    except ValueError as e:  # HybridConfig's own checks, named after the file (req's name it already)
        raise e if str(e).startswith(where) else ValueError(f"{where}: {e}") from None


# --------------------------------------------------------------------------- column orders

def qkvz_order(c: HybridConfig) -> np.ndarray:
    """Qwen3-Next's grouped in_proj_qkvz rows -> the q, k, v, z rows in head order: the
    index into the grouped rows of each row of `in_proj`'s first Ch + Hv Dv columns."""
    Hk, Dk, Dv, r = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim, \
        c.linear_num_value_heads // c.linear_num_key_heads
    group = 2 * Dk + 2 * r * Dv
    base = np.arange(Hk)[:, None] * group
    q = (base + np.arange(Dk)[None]).reshape(-1)
    k = (base + Dk + np.arange(Dk)[None]).reshape(-1)
    v = (base + 2 * Dk + np.arange(r * Dv)[None]).reshape(-1)
    z = (base + 2 * Dk + r * Dv + np.arange(r * Dv)[None]).reshape(-1)
    return np.concatenate([q, k, v, z])


def ba_order(c: HybridConfig) -> np.ndarray:
    """Qwen3-Next's grouped in_proj_ba rows -> b then a, each in value-head order."""
    Hk, r = c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads
    base = np.arange(Hk)[:, None] * 2 * r
    return np.concatenate([(base + np.arange(r)[None]).reshape(-1), (base + r + np.arange(r)[None]).reshape(-1)])


# --------------------------------------------------------------------------- from Hugging Face

def _experts(t: Tensors, m: str, c: HybridConfig) -> dict:
    E, D, Fm = c.num_experts, c.hidden_size, c.moe_intermediate_size
    if t.has(m + "experts.gate_up_proj"):  # transformers' fused layout
        return t.fused_experts(m + "experts.", E, D, Fm, keep_fp8=True)
    return t.experts(m + "experts.", E, D, Fm, keep_fp8=True)  # one tensor an expert; FP8 ones kept either way


def mlp_params(t: Tensors, m: str, c: HybridConfig, moe: bool) -> dict:
    """A layer's MLP (`m`: its tensors' prefix, ending in "mlp.")."""
    D = c.hidden_size
    if not moe:
        return dense_mlp_params(t, m, D, c.intermediate_size)
    out = {"router": {"kernel": t.param((m + "gate.weight", (c.num_experts, D)), dtype="float32").T},
           "experts": _experts(t, m, c)}
    if c.shared_expert_intermediate_size:
        out["shared_expert"] = dense_mlp_params(t, m + "shared_expert.", D, c.shared_expert_intermediate_size)
        out["shared_expert_gate"] = t.linear((m + "shared_expert_gate.weight", (1, D)))
    return out


def attention_params(t: Tensors, a: str, c: HybridConfig) -> dict:
    """A gated full-attention layer (`a`: its prefix, ending in "self_attn.")."""
    D, H, Hkv, Dh = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    names = ((a + "q_proj", 2 * H * Dh), (a + "k_proj", Hkv * Dh), (a + "v_proj", Hkv * Dh))
    p = {"qkv_proj": t.linear(*[(n + ".weight", (w, D)) for n, w in names]),
         "q_norm": {"weight": t.param((a + "q_norm.weight", (Dh,)))},
         "k_norm": {"weight": t.param((a + "k_norm.weight", (Dh,)))},
         "o_proj": t.linear((a + "o_proj.weight", (D, H * Dh)))}
    if c.attention_bias:
        p["qkv_proj"]["bias"] = t.param(*[(n + ".bias", (w,)) for n, w in names])
        p["o_proj"]["bias"] = t.param((a + "o_proj.bias", (D,)))
    kv_scale = t.kv_scales(a)
    if kv_scale is not None:  # an FP8 cache's per-layer scales (`cache.kv.cached_attention`)
        p["kv_scale"] = kv_scale
    return p


def linear_params(t: Tensors, a: str, c: HybridConfig) -> dict:
    """A Gated DeltaNet layer (`a`: its prefix, ending in "linear_attn.")."""
    D, Hv, Ch, Vd = c.hidden_size, c.linear_num_value_heads, c.conv_dim, c.value_dim
    if c.variant == "qwen3_next":
        in_proj = t.linear((a + "in_proj_qkvz.weight", (Ch + Vd, D)), (a + "in_proj_ba.weight", (2 * Hv, D)),
                           order=np.concatenate([qkvz_order(c), Ch + Vd + ba_order(c)]))
    else:
        in_proj = t.linear((a + "in_proj_qkv.weight", (Ch, D)), (a + "in_proj_z.weight", (Vd, D)),
                           (a + "in_proj_b.weight", (Hv, D)), (a + "in_proj_a.weight", (Hv, D)))
    C = c.conv_kernel
    return {"in_proj": in_proj,
            "conv_weight": t.as_param(t.take(a + "conv1d.weight", (Ch, 1, C))[:, 0]),
            "A_log": t.param((a + "A_log", (Hv,)), dtype="float32"),
            "dt_bias": t.param((a + "dt_bias", (Hv,)), dtype="float32"),
            "norm": {"weight": t.param((a + "norm.weight", (c.linear_value_head_dim,)))},
            "out_proj": t.linear((a + "out_proj.weight", (D, Vd)))}


def layer_params(t: Tensors, prefix: str, c: HybridConfig, layer: int) -> dict:
    D = c.hidden_size
    p = {"input_layernorm": {"weight": t.param((prefix + "input_layernorm.weight", (D,)))},
         "post_attention_layernorm": {"weight": t.param((prefix + "post_attention_layernorm.weight", (D,)))},
         "mlp": mlp_params(t, prefix + "mlp.", c, c.is_moe(layer))}
    if c.layer_types[layer] == LINEAR:
        p["linear_attn"] = linear_params(t, prefix + "linear_attn.", c)
    else:
        p["self_attn"] = attention_params(t, prefix + "self_attn.", c)
    return p


def text_prefix(t: Tensors) -> str:
    """Where the text model's tensors live: model.language_model. (a multimodal checkpoint,
    also read as a CausalLM) or model."""
    return "model.language_model." if t.has("model.language_model.embed_tokens.weight") else "model."


def target_weights_from_tensors(tensors: dict[str, np.ndarray], c: HybridConfig, where: str) -> dict:
    t = Tensors(tensors, where, c.dtype)
    D, V = c.hidden_size, c.vocab_size
    m = text_prefix(t)
    p: dict[str, Any] = {"embed_tokens": {"embedding": t.param((m + "embed_tokens.weight", (V, D)))}}
    for i in range(c.num_layers):
        p[f"layers_{i}"] = layer_params(t, f"{m}layers.{i}.", c, i)
    p["norm"] = {"weight": t.param((m + "norm.weight", (D,)))}
    if c.tie_word_embeddings or not t.has("lm_head.weight"):
        if not c.tie_word_embeddings:
            raise ValueError(f"{where}: missing tensor 'lm_head.weight'")
        t.ignore("lm_head.weight")
    else:
        p["lm_head"] = t.linear(("lm_head.weight", (V, D)))
    # the vision tower and the MTP layer are not the text target's
    t.ignore(*[k for k in list(t.tensors) if k.startswith(("mtp.", "model.visual.", "visual."))])
    t.finish()
    return {"params": p}


# --------------------------------------------------------------------------- to Hugging Face

def hf_config(c: HybridConfig) -> dict:
    """A config.json dict that transformers loads as this model (a CausalLM: the
    multimodal architectures are written as their text model)."""
    if c.rope.kind != "default":
        raise ValueError(f"export of rope kind {c.rope.kind!r} is not supported for {c.variant}")
    arch = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM",
            "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}[c.variant]
    model_type = {"qwen3_next": "qwen3_next", "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}[c.variant]
    cfg = {"architectures": [arch], "model_type": model_type, "vocab_size": c.vocab_size,
           "hidden_size": c.hidden_size, "num_hidden_layers": c.num_layers, "layer_types": list(c.layer_types),
           "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
           "rope_parameters": {"rope_type": "default", "rope_theta": c.rope.theta,
                               "partial_rotary_factor": c.rotary_dim / c.head_dim},
           "linear_num_key_heads": c.linear_num_key_heads, "linear_num_value_heads": c.linear_num_value_heads,
           "linear_key_head_dim": c.linear_key_head_dim, "linear_value_head_dim": c.linear_value_head_dim,
           "linear_conv_kernel_dim": c.conv_kernel, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps,
           "attention_bias": c.attention_bias, "max_position_embeddings": c.max_position_embeddings,
           "tie_word_embeddings": c.tie_word_embeddings, "dtype": c.dtype, "torch_dtype": c.dtype}
    if c.intermediate_size:
        cfg["intermediate_size"] = c.intermediate_size
    if c.num_experts:
        cfg.update(num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                   moe_intermediate_size=c.moe_intermediate_size,
                   shared_expert_intermediate_size=c.shared_expert_intermediate_size)
        if c.variant == "qwen3_next":
            cfg.update(norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=c.decoder_sparse_step,
                       mlp_only_layers=list(c.mlp_only_layers))
    if c.mtp_num_layers:
        cfg["mtp_num_hidden_layers"] = c.mtp_num_layers
    if c.bos_token_id is not None:
        cfg["bos_token_id"] = c.bos_token_id
    if c.eos_token_ids:
        cfg["eos_token_id"] = c.eos_token_ids[0] if len(c.eos_token_ids) == 1 else list(c.eos_token_ids)
    return cfg


def mlp_tensors(mp: dict, m: str, c: HybridConfig, out: dict):
    dt = c.dtype
    if "experts" not in mp:
        dense_mlp_tensors(mp, m, c.intermediate_size, out, dt)
        return
    out[m + "gate.weight"] = np.ascontiguousarray(to_numpy(mp["router"]["kernel"], dt).T)
    for e, ws in enumerate(unstacked_experts(mp["experts"], dt)):
        for n, w in zip(("gate", "up", "down"), ws):
            out[f"{m}experts.{e}.{n}_proj.weight"] = w
    if "shared_expert" in mp:
        dense_mlp_tensors(mp["shared_expert"], m + "shared_expert.", c.shared_expert_intermediate_size, out, dt)
        out[m + "shared_expert_gate.weight"] = hf_linear(mp["shared_expert_gate"], dt)


def attention_tensors(ap: dict, a: str, c: HybridConfig, out: dict):
    dt = c.dtype
    H, Hkv, Dh = c.num_heads, c.num_kv_heads, c.head_dim
    q, k, v = np.split(hf_linear(ap["qkv_proj"], dt), [2 * H * Dh, 2 * H * Dh + Hkv * Dh], axis=0)
    out.update({a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": v,
                a + "o_proj.weight": hf_linear(ap["o_proj"], dt),
                a + "q_norm.weight": to_numpy(ap["q_norm"]["weight"], dt),
                a + "k_norm.weight": to_numpy(ap["k_norm"]["weight"], dt)})
    if "bias" in ap["qkv_proj"]:
        qb, kb, vb = np.split(to_numpy(ap["qkv_proj"]["bias"], dt), [2 * H * Dh, 2 * H * Dh + Hkv * Dh])
        out.update({a + "q_proj.bias": qb, a + "k_proj.bias": kb, a + "v_proj.bias": vb,
                    a + "o_proj.bias": to_numpy(ap["o_proj"]["bias"], dt)})
    out.update(kv_scale_tensors(ap, a))


def linear_tensors(lp: dict, a: str, c: HybridConfig, out: dict):
    dt = c.dtype
    Ch, Vd, Hv = c.conv_dim, c.value_dim, c.linear_num_value_heads
    w = hf_linear(lp["in_proj"], dt)  # [Ch + Vd + 2Hv, D]
    if c.variant == "qwen3_next":
        qkvz, ba = np.empty_like(w[:Ch + Vd]), np.empty_like(w[Ch + Vd:])
        qkvz[qkvz_order(c)] = w[:Ch + Vd]
        ba[ba_order(c)] = w[Ch + Vd:]
        out.update({a + "in_proj_qkvz.weight": qkvz, a + "in_proj_ba.weight": ba})
    else:
        qkv, z, b, a_ = np.split(w, [Ch, Ch + Vd, Ch + Vd + Hv], axis=0)
        out.update({a + "in_proj_qkv.weight": qkv, a + "in_proj_z.weight": z, a + "in_proj_b.weight": b,
                    a + "in_proj_a.weight": a_})
    out.update({a + "conv1d.weight": to_numpy(lp["conv_weight"], dt)[:, None, :],
                a + "A_log": to_numpy(lp["A_log"], "float32"), a + "dt_bias": to_numpy(lp["dt_bias"], "float32"),
                a + "norm.weight": to_numpy(lp["norm"]["weight"], dt),
                a + "out_proj.weight": hf_linear(lp["out_proj"], dt)})


def target_tensors(c: HybridConfig, weights) -> dict:
    """Weights as the CausalLM's tensors (`hf_config`'s architecture)."""
    if c.devices > 1:
        raise ValueError(f"this model is split over {c.devices} devices (its columns reordered for them): "
                         "export the model loaded on one device")
    p, dt = weights["params"], c.dtype
    out = end_tensors(p, c.tie_word_embeddings, dt)
    for i in range(c.num_layers):
        lp, pre = p[f"layers_{i}"], f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{pre}{norm}.weight"] = to_numpy(lp[norm]["weight"], dt)
        if "linear_attn" in lp:
            linear_tensors(lp["linear_attn"], pre + "linear_attn.", c, out)
        else:
            attention_tensors(lp["self_attn"], pre + "self_attn.", c, out)
        mlp_tensors(lp["mlp"], pre + "mlp.", c, out)
    return out
