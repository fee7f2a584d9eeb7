"""Frozen, hashable configuration dataclasses (usable as static jit arguments).

`ModelConfig` describes a Llama-family decoder as Hugging Face defines it (Llama 2/3/3.1,
Qwen2/2.5, Qwen3, Mistral). `DraftConfig` wraps the model config of a draft with what kind
of draft it is. `SpecConfig` and `CacheConfig` are the user-facing knobs of generation.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

DTYPES = ("float32", "bfloat16", "float16")

# Hugging Face `architectures` entries a target may declare, by family.
TARGET_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_ARCH_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                       "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: base `theta` and an optional scaling rule (`linear`, `llama3`)."""

    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Inverse frequencies [Dh/2] in float32, computed as transformers does."""
        exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
        inv = (np.float32(1.0) / (np.float32(self.theta) ** exponent)).astype(np.float32)
        if self.kind == "linear":
            inv = (inv / np.float32(self.factor)).astype(np.float32)
        elif self.kind == "llama3":
            old = self.original_max_position_embeddings
            low_wavelen = old / self.low_freq_factor
            high_wavelen = old / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            inv = np.where(medium, smoothed, scaled).astype(np.float32)
        return inv


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder. Letters: V vocab, D width, H/Hkv heads, Dh head dim."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # Per-layer sliding window (0: full attention), length num_layers.
    sliding_windows: tuple[int, ...] = ()
    dtype: str = "float32"
    model_type: str = "llama"
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (0,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError("sliding_windows must have one entry per layer")

    @property
    def jnp_dtype(self):
        import jax.numpy as jnp
        return jnp.dtype(self.dtype)

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def num_params(self) -> int:
        D, F, Dh = self.hidden_size, self.intermediate_size, self.head_dim
        attn = D * (self.num_heads + 2 * self.num_kv_heads) * Dh + self.num_heads * Dh * D
        per_layer = attn + 3 * D * F + 2 * D
        head = 0 if self.tie_word_embeddings else self.vocab_size * D
        return self.vocab_size * D + self.num_layers * per_layer + D + head


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """A draft model: `kind` is 'eagle' (EAGLE-1/2), 'eagle3' or 'standalone'.

    `model` describes the draft's own decoder layer(s) (for EAGLE heads, num_layers is the
    number of draft layers). EAGLE-3 fields: `target_hidden_size`, `aux_layers` (the target
    layers whose *inputs* are captured) and `draft_vocab_size`.
    """

    kind: str
    model: ModelConfig
    target_hidden_size: int = 0
    aux_layers: tuple[int, ...] = ()
    draft_vocab_size: int = 0
    fc_bias: bool = False

    def __post_init__(self):
        if self.kind not in ("eagle", "eagle3", "standalone"):
            raise ValueError(f"unknown draft kind {self.kind!r}")

    @property
    def lag(self) -> int:
        """How many slots ahead of an EAGLE head a standalone draft's cache runs (0 or 1).

        An EAGLE head's slot i pairs token i+1 with the target's feature at i; a standalone
        draft's slot i holds token i itself, so it also holds the current root token.
        """
        return 1 if self.kind == "standalone" else 0


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding shape: S draft steps, K branches per step, N verified nodes.

    topk=1 is a chain (N must be S+1); topk>1 builds a tree from the best N-1 of the
    K + (S-1)K^2 candidates, root included in N. Default N: S+1 (chain), S*K+1 (tree).
    """

    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int | None = None

    def __post_init__(self):
        for name in ("num_steps", "topk"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"SpecConfig.{name} must be an int >= 1, got {v!r}")
        if self.num_draft_tokens is None:  # a chain: S+1; a tree: S*K+1 (at most every candidate)
            object.__setattr__(self, "num_draft_tokens",
                               min(self.max_candidates, self.num_steps * self.topk) + 1)
        n = self.num_draft_tokens
        if not isinstance(n, int) or isinstance(n, bool) or n < 2:
            raise ValueError(f"SpecConfig.num_draft_tokens must be an int >= 2, got {n!r}")
        if self.topk == 1 and n != self.num_steps + 1:
            raise ValueError(f"with topk=1 (a chain) num_draft_tokens must be num_steps+1 = "
                             f"{self.num_steps + 1}, got {n}")
        if n - 1 > self.max_candidates:
            raise ValueError(f"num_draft_tokens-1 = {n - 1} exceeds the {self.max_candidates} candidates "
                             f"that num_steps={self.num_steps}, topk={self.topk} produce (K + (S-1)K^2)")

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @property
    def max_candidates(self) -> int:
        S, K = self.num_steps, self.topk
        return K + (S - 1) * K * K


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """KV cache: `kind` 'dense' (a region per request) or 'paged' (a shared page pool).

    max_len: tokens a request may hold (prompt + generated); None sizes it from the call.
    page_size: tokens per page (paged only, any value >= 1).
    num_pages: pages in the pool (paged only); None gives every request max_len worth.
    """

    kind: str = "dense"
    max_len: int | None = None
    page_size: int = 16
    num_pages: int | None = None

    def __post_init__(self):
        if self.kind not in ("dense", "paged"):
            raise ValueError(f"CacheConfig.kind must be 'dense' or 'paged', got {self.kind!r}")
        for name in ("max_len", "num_pages"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"CacheConfig.{name} must be a positive int or None, got {v!r}")
        if not isinstance(self.page_size, int) or isinstance(self.page_size, bool) or self.page_size < 1:
            raise ValueError(f"CacheConfig.page_size must be an int >= 1, got {self.page_size!r}")


def _rope_from_hf(cfg: Mapping[str, Any]) -> RopeConfig:
    params = cfg.get("rope_parameters")
    if params is None:
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    params = dict(params)
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig(theta=theta, kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        return RopeConfig(theta=theta, kind="llama3", factor=float(params["factor"]),
                          low_freq_factor=float(params["low_freq_factor"]),
                          high_freq_factor=float(params["high_freq_factor"]),
                          original_max_position_embeddings=int(params["original_max_position_embeddings"]))
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


def model_config_from_hf(cfg: Mapping[str, Any], *, dtype: str | None = None,
                         require_architecture: bool = True) -> ModelConfig:
    """Builds a ModelConfig from a Hugging Face config.json dict."""
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type", "llama")
    arch = next((a for a in archs if a in TARGET_ARCHITECTURES), None)
    if arch is None:
        if require_architecture:
            raise ValueError(f"unsupported architecture {archs or model_type!r}; jspec supports "
                             f"{sorted(TARGET_ARCHITECTURES)}")
        arch = _ARCH_BY_MODEL_TYPE.get(model_type, "LlamaForCausalLM")
    family = TARGET_ARCHITECTURES[arch]
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {act!r} (jspec supports silu)")
    D = int(cfg["hidden_size"])
    H = int(cfg["num_attention_heads"])
    Hkv = int(cfg.get("num_key_value_heads") or H)
    head_dim = cfg.get("head_dim") or D // H
    L = int(cfg["num_hidden_layers"])
    if family == "mistral":
        windows = (int(cfg.get("sliding_window") or 0),) * L
    elif family in ("qwen2", "qwen3") and cfg.get("sliding_window"):
        types = cfg.get("layer_types")
        if types is None:
            first = int(cfg.get("max_window_layers", L)) if cfg.get("use_sliding_window") else L
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(L)]
        windows = tuple(int(cfg["sliding_window"]) if t == "sliding_attention" else 0 for t in types)
    else:
        windows = (0,) * L
    eos = cfg.get("eos_token_id")
    eos = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []))
    if dtype is None:
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        dtype = dtype if dtype in DTYPES else "float32"
    attention_bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]), hidden_size=D,
        intermediate_size=int(cfg["intermediate_size"]), num_layers=L, num_heads=H,
        num_kv_heads=Hkv, head_dim=int(head_dim), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_hf(cfg), max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=True if family == "qwen2" else attention_bias and family != "mistral",
        o_bias=attention_bias and family in ("llama", "qwen3"),
        mlp_bias=bool(cfg.get("mlp_bias", False)), qk_norm=family == "qwen3",
        sliding_windows=windows, dtype=dtype, model_type=family, architecture=arch,
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos)
