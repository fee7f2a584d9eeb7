"""DeepSeek-V2/V3 checkpoints in Hugging Face's format: `DeepseekConfig` from config.json
(both the `rope_parameters` and the older `rope_scaling` + `rope_theta` forms) and weights
in both directions. Routed experts are read as they are on disk, one tensor per expert
and projection (`mlp.experts.{e}.{gate,up,down}_proj.weight`), and stacked per layer; the
shared experts' MLP (`mlp.shared_experts.*`, width S*Fm) is stacked the same way as S
experts of width Fm."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from jspec.config import DTYPES, RopeConfig
from jspec.kernels.moe.route import Routing
from jspec.models.llama_hf import rope_from_hf
from jspec.tensors import HostParam, Tensors, hf_linear, kv_scale_tensors, to_numpy, unstacked_experts

TARGET_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
# A NextN directory (SGLang's export of a checkpoint's MTP layer) -> the model it came from.
NEXTN_ARCHITECTURES = {"DeepseekV3ForCausalLMNextN": "DeepseekV3ForCausalLM"}


@dataclasses.dataclass(frozen=True)
class DeepseekConfig:
    """A DeepSeek-V2/V3 decoder: MLA attention and (after the first `first_k_dense_replace`
    dense layers) MoE MLPs. Letters: V vocab, D width, H heads, Dn/Dr/Dv the query-key
    nope/rope and value head dims, Dc the KV latent (kv_lora_rank), Rq the query latent
    (q_lora_rank, 0: a plain q_proj), E routed experts, k experts a token, Fm expert width.
    DeepSeek-V3.2's sparse attention (DSA, `index_topk` > 0): a lightning indexer of Hi
    heads (index_n_heads) of Di dims (index_head_dim) scores every visible token and each
    query attends to its top Ki (index_topk) only."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense layers' MLP width
    num_layers: int
    num_heads: int
    kv_lora_rank: int
    q_lora_rank: int  # 0: no query latent (V2-Lite)
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    scoring: str = "sigmoid"  # sigmoid (V3) | softmax (V2)
    topk_method: str = "noaux_tc"  # noaux_tc (V3) | greedy | group_limited_greedy (V2)
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    rope_interleave: bool = True  # rope pairs (x0, x1), (x2, x3), ... (V2 always)
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0  # MTP layers stored after the decoder layers
    index_topk: int = 0  # Ki: tokens each query attends to (0: every visible token, no indexer)
    index_head_dim: int = 0  # Di
    index_n_heads: int = 0  # Hi
    dtype: str = "float32"
    model_type: str = "deepseek_v3"
    architecture: str = "DeepseekV3ForCausalLM"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Several devices (`models.deepseek_split.split_deepseek`): the model split over `devices`;
    # `per_device`: this config is one device's block of it (`block`).
    devices: int = 1
    per_device: bool = False

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"unsupported topk_method {self.topk_method!r} (supported: {TOPK_METHODS})")
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"n_routed_experts ({self.n_routed_experts}) must be a multiple of n_group "
                             f"({self.n_group})")
        if self.n_routed_experts:
            self.routing  # noqa: B018  (raises for a routing no token can follow)
        if self.index_topk and not (self.q_lora_rank and self.index_head_dim >= self.qk_rope_head_dim
                                    and self.index_n_heads > 0):
            raise ValueError("sparse attention (index_topk > 0) needs a query latent (q_lora_rank), index_n_heads > 0 "
                             f"and index_head_dim >= qk_rope_head_dim ({self.qk_rope_head_dim}), got q_lora_rank="
                             f"{self.q_lora_rank}, index_n_heads={self.index_n_heads}, index_head_dim="
                             f"{self.index_head_dim}")

    @property
    def routing(self) -> Routing:
        """The MoE layers' routing rule, the shared experts as the extra slots."""
        return Routing(self.n_routed_experts, self.num_experts_per_tok, scoring=self.scoring,
                       method=self.topk_method, n_group=self.n_group, topk_group=self.topk_group,
                       norm_topk_prob=self.norm_topk_prob, scaling=self.routed_scaling_factor,
                       num_extra=self.n_shared_experts)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5 * self.rope.softmax_mscale()

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and self.n_routed_experts > 0

    def first_of_kind(self, layer: int) -> int:
        """The first layer index of `layer`'s kind (dense or MoE): layers of one kind are
        one definition (`layers.call_layer`)."""
        return self.first_k_dense_replace if self.is_moe(layer) else 0

    @property
    def jnp_dtype(self):
        import jax.numpy as jnp
        return jnp.dtype(self.dtype)

    def replace(self, **kw) -> "DeepseekConfig":
        return dataclasses.replace(self, **kw)

    def block(self) -> "DeepseekConfig":
        """The config one device's layer code runs with when the model is split over
        `devices`: H/n heads and 1/n of the dense MLPs' width (its E/n routed experts and
        the shared experts' Fm/n columns follow from the arrays it holds; routing still
        chooses among all E experts); attention and MLP outputs are partial sums that the
        layer adds up over the devices."""
        n = self.devices
        return self.replace(num_heads=self.num_heads // n, intermediate_size=self.intermediate_size // n,
                            per_device=True)


def _get(cfg: Mapping[str, Any], where: str, name: str, default=None, required: bool = False):
    if name not in cfg or cfg[name] is None:
        if required:
            raise ValueError(f"{where}: config.json lacks {name!r}")
        return default
    return cfg[name]


def config_from_hf(cfg: Mapping[str, Any], dtype: str | None = None, where: str = "config.json") -> DeepseekConfig:
    archs = [NEXTN_ARCHITECTURES.get(a, a) for a in cfg.get("architectures") or []]
    arch = next((a for a in archs if a in TARGET_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"{where}: architectures {archs!r} name no DeepSeek model {TARGET_ARCHITECTURES}")
    v32 = arch == "DeepseekV32ForCausalLM"
    v3 = arch in ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{where}: unsupported hidden_act {act!r} (jspec supports silu)")
    if int(cfg.get("moe_layer_freq", 1) or 1) != 1:
        raise ValueError(f"{where}: moe_layer_freq != 1 is not supported")
    req = lambda n: _get(cfg, where, n, required=True)  # noqa: E731
    experts = _get(cfg, where, "n_routed_experts", 0) or 0
    method = _get(cfg, where, "topk_method", "noaux_tc" if v3 else "greedy")
    if dtype is None:
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        dtype = dtype if dtype in DTYPES else "float32"
    eos = cfg.get("eos_token_id")
    eos = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []))
    return DeepseekConfig(
        vocab_size=int(req("vocab_size")), hidden_size=int(req("hidden_size")),
        intermediate_size=int(req("intermediate_size")), num_layers=int(req("num_hidden_layers")),
        num_heads=int(req("num_attention_heads")), kv_lora_rank=int(req("kv_lora_rank")),
        q_lora_rank=int(_get(cfg, where, "q_lora_rank", 0) or 0), qk_nope_head_dim=int(req("qk_nope_head_dim")),
        qk_rope_head_dim=int(req("qk_rope_head_dim")), v_head_dim=int(req("v_head_dim")),
        moe_intermediate_size=int(_get(cfg, where, "moe_intermediate_size", 0) or 0), n_routed_experts=int(experts),
        n_shared_experts=int(_get(cfg, where, "n_shared_experts", 0) or 0),
        num_experts_per_tok=int(_get(cfg, where, "num_experts_per_tok", 1) or 1),
        first_k_dense_replace=int(_get(cfg, where, "first_k_dense_replace", 0) or 0),
        scoring="sigmoid" if v3 else "softmax", topk_method=method,
        n_group=int(_get(cfg, where, "n_group", 1) or 1), topk_group=int(_get(cfg, where, "topk_group", 1) or 1),
        norm_topk_prob=bool(_get(cfg, where, "norm_topk_prob", v3)),
        routed_scaling_factor=float(_get(cfg, where, "routed_scaling_factor", 1.0)),
        rms_norm_eps=float(_get(cfg, where, "rms_norm_eps", 1e-6)), rope=rope_from_hf(cfg),
        rope_interleave=bool(cfg.get("rope_interleave", True)) if v3 and not v32 else True,
        attention_bias=bool(cfg.get("attention_bias", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers", 0) or 0), dtype=dtype,
        index_topk=int(req("index_topk")) if v32 else 0, index_head_dim=int(req("index_head_dim")) if v32 else 0,
        index_n_heads=int(req("index_n_heads")) if v32 else 0,
        model_type="deepseek_v32" if v32 else "deepseek_v3" if v3 else "deepseek_v2", architecture=arch,
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos)


def mlp_params(t: Tensors, prefix: str, D: int, F: int) -> dict:
    return {"gate_up_proj": t.linear((prefix + "gate_proj.weight", (F, D)), (prefix + "up_proj.weight", (F, D))),
            "down_proj": t.linear((prefix + "down_proj.weight", (D, F)))}


def kv_b_params(t: Tensors, name: str, c: DeepseekConfig) -> dict:
    """kv_b_proj [H*(Dn+Dv), Dc] -> its halves as `models.deepseek.MLAttention` keeps them:
    {"w_uk": [Dc, H, Dn], "w_uv": [H, Dv, Dc]}."""
    H, Dn, Dv, Dc = c.num_heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
    kv_b = t.take(name, (H * (Dn + Dv), Dc)).reshape(H, Dn + Dv, Dc)  # views: read lazily, a block a device
    return {"w_uk": HostParam([kv_b[:, :Dn].transpose(2, 0, 1)], t.dtype), "w_uv": HostParam([kv_b[:, Dn:]], t.dtype)}


def kv_b_tensor(attn: dict, dt: str) -> np.ndarray:
    """`kv_b_params`' inverse: kv_b_proj.weight [H*(Dn+Dv), Dc]."""
    w_uk, w_uv = to_numpy(attn["w_uk"], dt), to_numpy(attn["w_uv"], dt)  # [Dc,H,Dn], [H,Dv,Dc]
    kv_b = np.concatenate([w_uk.transpose(1, 2, 0), w_uv], axis=1)  # [H, Dn+Dv, Dc]
    return np.ascontiguousarray(kv_b.reshape(-1, kv_b.shape[-1]))


def _q_input_proj(c: DeepseekConfig) -> tuple[str, int]:
    """The query's first projection, whose columns lead `qkv_a_proj`: (name, width)."""
    if c.q_lora_rank:
        return "q_a_proj", c.q_lora_rank
    return "q_proj", c.num_heads * c.qk_head_dim


def indexer_params(t: Tensors, prefix: str, c: DeepseekConfig) -> dict:
    """DSA's lightning indexer (`models.deepseek.Indexer`): its query from the query latent
    (wq_b), its key from the layer's normed input (wk, then a LayerNorm with bias), the
    per-head weights (weights_proj, float32 as the checkpoint keeps it)."""
    D, Hi, Di = c.hidden_size, c.index_n_heads, c.index_head_dim
    return {"wq_b": t.linear((prefix + "wq_b.weight", (Hi * Di, c.q_lora_rank))),
            "wk": t.linear((prefix + "wk.weight", (Di, D))),
            "k_norm": {"weight": t.param((prefix + "k_norm.weight", (Di,))),
                       "bias": t.param((prefix + "k_norm.bias", (Di,)))},
            "weights_proj": {"kernel": t.param((prefix + "weights_proj.weight", (Hi, D)), dtype="float32").T}}


def layer_params(t: Tensors, prefix: str, c: DeepseekConfig, layer: int) -> dict:
    """One decoder layer's params from `prefix`-named tensors."""
    D, H = c.hidden_size, c.num_heads
    a = prefix + "self_attn."
    attn: dict[str, Any] = {}
    Dcr = c.kv_lora_rank + c.qk_rope_head_dim
    q_name, Q = _q_input_proj(c)
    # q_proj (or q_a_proj) and kv_a_proj_with_mqa read the same normed input: one matrix
    attn["qkv_a_proj"] = t.linear((a + q_name + ".weight", (Q, D)), (a + "kv_a_proj_with_mqa.weight", (Dcr, D)))
    if c.attention_bias:  # q_proj has no bias in either model (q_a_proj has)
        q_bias = t.take(a + q_name + ".bias", (Q,)) if c.q_lora_rank else np.zeros((Q,), np.float32)
        attn["qkv_a_proj"]["bias"] = t.as_param(
            np.concatenate([q_bias.astype(np.float32), t.take(a + "kv_a_proj_with_mqa.bias", (Dcr,)).astype(np.float32)]))
    if c.q_lora_rank:
        attn["q_a_layernorm"] = {"weight": t.param((a + "q_a_layernorm.weight", (c.q_lora_rank,)))}
        attn["q_b_proj"] = t.linear((a + "q_b_proj.weight", (H * c.qk_head_dim, c.q_lora_rank)))
    attn["kv_a_layernorm"] = {"weight": t.param((a + "kv_a_layernorm.weight", (c.kv_lora_rank,)))}
    attn.update(kv_b_params(t, a + "kv_b_proj.weight", c))
    attn["o_proj"] = t.linear((a + "o_proj.weight", (D, H * c.v_head_dim)))
    if c.attention_bias:
        attn["o_proj"]["bias"] = t.param((a + "o_proj.bias", (D,)))
    if c.index_topk:
        attn["indexer"] = indexer_params(t, a + "indexer.", c)
    latent_scale = t.latent_scale(a)
    if latent_scale is not None:  # an FP8 latent cache's per-layer scale (`models.deepseek.MLAttention`)
        attn["kv_scale"] = latent_scale
    m = prefix + "mlp."
    if c.is_moe(layer):
        E, S, Fm = c.n_routed_experts, c.n_shared_experts, c.moe_intermediate_size
        mlp: dict[str, Any] = {"router": {"kernel": t.param((m + "gate.weight", (E, D))).T.astype("float32")},
                               "experts": t.experts(m + "experts.", E, D, Fm, keep_fp8=True)}
        if S:  # the shared MLP of width S*Fm as S experts of width Fm (see `models.deepseek.MoE`)
            mlp["shared_experts"] = t.shared_experts(m + "shared_experts.", S, D, Fm, keep_fp8=True)
        if c.scoring == "sigmoid":
            mlp["router"]["bias"] = t.param((m + "gate.e_score_correction_bias", (E,)), dtype="float32")
    else:
        mlp = mlp_params(t, m, D, c.intermediate_size)
    return {"self_attn": attn, "mlp": mlp,
            "input_layernorm": {"weight": t.param((prefix + "input_layernorm.weight", (D,)))},
            "post_attention_layernorm": {"weight": t.param((prefix + "post_attention_layernorm.weight", (D,)))}}


def target_weights_from_tensors(tensors: dict[str, np.ndarray], c: DeepseekConfig, where: str) -> dict:
    t = Tensors(tensors, where, c.dtype)
    D, V = c.hidden_size, c.vocab_size
    p: dict[str, Any] = {"embed_tokens": {"embedding": t.param(("model.embed_tokens.weight", (V, D)))}}
    for i in range(c.num_layers):
        p[f"layers_{i}"] = layer_params(t, f"model.layers.{i}.", c, i)
    p["norm"] = {"weight": t.param(("model.norm.weight", (D,)))}
    if c.tie_word_embeddings:
        t.ignore("lm_head.weight")
    else:
        p["lm_head"] = t.linear(("lm_head.weight", (V, D)))
    # The MTP (NextN) layers after the decoder layers belong to the MTP draft.
    t.ignore(*[k for k in list(t.tensors) if k.startswith(tuple(f"model.layers.{c.num_layers + j}."
                                                                for j in range(c.num_nextn_predict_layers)))])
    t.finish()
    return {"params": p}


def hf_config(c: DeepseekConfig) -> dict:
    """A config.json dict that transformers loads as this model."""
    rope: dict[str, Any] = {"rope_type": c.rope.kind, "rope_theta": c.rope.theta}
    if c.rope.kind == "yarn":
        rope.update(factor=c.rope.factor, original_max_position_embeddings=c.rope.original_max_position_embeddings,
                    beta_fast=c.rope.beta_fast, beta_slow=c.rope.beta_slow, mscale=c.rope.mscale,
                    mscale_all_dim=c.rope.mscale_all_dim)
    elif c.rope.kind != "default":
        raise ValueError(f"export of rope kind {c.rope.kind!r} is not supported for DeepSeek")
    cfg = {"architectures": [c.architecture], "model_type": c.model_type, "vocab_size": c.vocab_size,
           "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "moe_intermediate_size": c.moe_intermediate_size, "num_hidden_layers": c.num_layers,
           "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_heads,
           "kv_lora_rank": c.kv_lora_rank, "q_lora_rank": c.q_lora_rank or None,
           "qk_nope_head_dim": c.qk_nope_head_dim, "qk_rope_head_dim": c.qk_rope_head_dim,
           "v_head_dim": c.v_head_dim, "n_routed_experts": c.n_routed_experts,
           "n_shared_experts": c.n_shared_experts, "num_experts_per_tok": c.num_experts_per_tok,
           "first_k_dense_replace": c.first_k_dense_replace, "topk_method": c.topk_method,
           "n_group": c.n_group, "topk_group": c.topk_group, "norm_topk_prob": c.norm_topk_prob,
           "routed_scaling_factor": c.routed_scaling_factor, "rms_norm_eps": c.rms_norm_eps,
           "rope_parameters": rope, "attention_bias": c.attention_bias, "hidden_act": "silu",
           "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
           "num_nextn_predict_layers": c.num_nextn_predict_layers, "dtype": c.dtype, "torch_dtype": c.dtype}
    if c.model_type == "deepseek_v3":
        cfg["rope_interleave"] = c.rope_interleave
    if c.index_topk:
        cfg.update(index_topk=c.index_topk, index_head_dim=c.index_head_dim, index_n_heads=c.index_n_heads)
    if c.bos_token_id is not None:
        cfg["bos_token_id"] = c.bos_token_id
    if c.eos_token_ids:
        cfg["eos_token_id"] = c.eos_token_ids[0] if len(c.eos_token_ids) == 1 else list(c.eos_token_ids)
    return cfg


def end_tensors(p: dict, tie: bool, dt: str) -> dict:
    """A decoder's embedding, final norm and (untied) LM head as Hugging Face tensors."""
    out = {"model.embed_tokens.weight": to_numpy(p["embed_tokens"]["embedding"], dt),
           "model.norm.weight": to_numpy(p["norm"]["weight"], dt)}
    if not tie:
        out["lm_head.weight"] = hf_linear(p["lm_head"], dt)
    return out


def mlp_tensors(p: dict, prefix: str, F: int, out: dict, dt: str):
    gate, up = np.split(hf_linear(p["gate_up_proj"], dt), [F], axis=0)
    out.update({prefix + "gate_proj.weight": gate, prefix + "up_proj.weight": up,
                prefix + "down_proj.weight": hf_linear(p["down_proj"], dt)})


def target_tensors(c: DeepseekConfig, weights) -> dict:
    """Weights as `Deepseek{V2,V3}ForCausalLM` tensors (experts one tensor each, as on disk)."""
    p = weights["params"]
    out = end_tensors(p, c.tie_word_embeddings, c.dtype)
    for i in range(c.num_layers):
        layer_tensors(p[f"layers_{i}"], f"model.layers.{i}.", c, i, out)
    return out


def layer_tensors(lp: dict, pre: str, c: DeepseekConfig, layer: int, out: dict) -> dict:
    """One decoder layer's params -> `pre`-named tensors in `out` (experts one tensor each)."""
    if c.devices > 1:
        raise ValueError(f"this model is split over {c.devices} devices (its columns reordered for them): "
                         "export the model loaded on one device")
    dt = c.dtype
    out[f"{pre}self_attn.kv_b_proj.weight"] = kv_b_tensor(lp["self_attn"], dt)
    q_name, Q = _q_input_proj(c)
    qkv = lp["self_attn"]["qkv_a_proj"]
    weight = hf_linear(qkv, dt)  # [Q + Dc + Dr, D]
    for name, rows in ((q_name, slice(0, Q)), ("kv_a_proj_with_mqa", slice(Q, None))):
        out[f"{pre}self_attn.{name}.weight"] = np.ascontiguousarray(weight[rows])
        if "bias" in qkv and name != "q_proj":
            out[f"{pre}self_attn.{name}.bias"] = to_numpy(qkv["bias"], dt)[rows]
    out.update(kv_scale_tensors(lp["self_attn"], f"{pre}self_attn."))
    for name, sub in lp["self_attn"].items():
        key = f"{pre}self_attn.{name}."
        if name in ("w_uk", "w_uv", "qkv_a_proj", "kv_scale"):
            continue
        if name == "indexer":
            ix = f"{pre}self_attn.indexer."
            out[ix + "wq_b.weight"], out[ix + "wk.weight"] = hf_linear(sub["wq_b"], dt), hf_linear(sub["wk"], dt)
            out[ix + "k_norm.weight"], out[ix + "k_norm.bias"] = (to_numpy(sub["k_norm"][n], dt) for n in ("weight", "bias"))
            out[ix + "weights_proj.weight"] = np.ascontiguousarray(to_numpy(sub["weights_proj"]["kernel"], "float32").T)
            continue
        if "kernel" in sub:
            out[key + "weight"] = hf_linear(sub, dt)
            if "bias" in sub:
                out[key + "bias"] = to_numpy(sub["bias"], dt)
        else:
            out[key + "weight"] = to_numpy(sub["weight"], dt)
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[f"{pre}{norm}.weight"] = to_numpy(lp[norm]["weight"], dt)
    m, mp = pre + "mlp.", lp["mlp"]
    if not c.is_moe(layer):
        mlp_tensors(mp, m, c.intermediate_size, out, dt)
        return out
    out[m + "gate.weight"] = np.ascontiguousarray(to_numpy(mp["router"]["kernel"], "float32").T).astype(
        to_numpy(lp["input_layernorm"]["weight"], dt).dtype)
    if "bias" in mp["router"]:
        out[m + "gate.e_score_correction_bias"] = to_numpy(mp["router"]["bias"], "float32")
    for e, ws in enumerate(unstacked_experts(mp["experts"], dt)):
        for n, w in zip(("gate", "up", "down"), ws):
            out[f"{m}experts.{e}.{n}_proj.weight"] = w
    if "shared_experts" in mp:  # the S experts back into one MLP of width S*Fm
        gate, up, down = zip(*unstacked_experts(mp["shared_experts"], dt))
        out.update({m + "shared_experts.gate_proj.weight": np.concatenate(gate, axis=0),
                    m + "shared_experts.up_proj.weight": np.concatenate(up, axis=0),
                    m + "shared_experts.down_proj.weight": np.concatenate(down, axis=1)})
    return out
