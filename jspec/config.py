"""Frozen, hashable configuration dataclasses (usable as static jit arguments). The bottom
layer: it imports nothing of jspec.

`ModelConfig` describes a Llama-family decoder as Hugging Face defines it (Llama 2/3/3.1,
Qwen2/2.5, Qwen3, Mistral); its family (`jspec.models.llama`) parses it from config.json.
Draft kinds are their own frozen classes (`jspec.drafts`). `SpecConfig` and `CacheConfig`
are the user-facing knobs of generation. The settings that tune kernels and compilation
are `jspec.tuning.Tuning`, made of the tile dataclasses that sit beside their kernels.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: base `theta` and an optional scaling rule (`linear`, `llama3`,
    `yarn`). YaRN also scales cos and sin (`attention_factor`), and DeepSeek's attention
    multiplies its softmax scale by `softmax_mscale()`."""

    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0
    mscale: float = 0.0  # yarn: 0 = not given
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # yarn: None = from factor, mscale, mscale_all_dim
    truncate: bool = True

    def cos_sin_scale(self) -> float:
        """The factor on cos and sin (YaRN's attention factor; 1 otherwise)."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return float(_yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim))
        return _yarn_mscale(self.factor)

    def softmax_mscale(self) -> float:
        """DeepSeek's factor on the softmax scale: mscale(factor, mscale_all_dim) squared
        for a scaled RoPE with `mscale_all_dim`, else 1."""
        if self.kind == "default" or not self.mscale_all_dim:
            return 1.0
        m = _yarn_mscale(self.factor, self.mscale_all_dim)
        return m * m

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
        elif self.kind == "yarn":
            inv = self._yarn_inv_freq(inv, head_dim)
        return inv

    def _yarn_inv_freq(self, extrapolation: np.ndarray, dim: int) -> np.ndarray:
        """YaRN: interpolated (divided by factor) low frequencies, the original high ones,
        and a linear ramp between the correction dimensions (as transformers computes it)."""
        base, old = self.theta, self.original_max_position_embeddings

        def correction_dim(rotations):
            return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
        keep = (np.float32(1) - ramp.astype(np.float32)).astype(np.float32)  # weight of the original frequency
        pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim))
        interpolation = (np.float32(1) / (np.float32(self.factor) * pos_freqs.astype(np.float32))).astype(np.float32)
        return (interpolation * (np.float32(1) - keep) + extrapolation * keep).astype(np.float32)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


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


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding shape: S draft steps, K branches per step, N verified nodes.

    topk=1 is a chain (N must be S+1); topk>1 builds a tree from the best N-1 of the
    K + (S-1)K^2 candidates, root included in N. Default N: S+1 (chain), S*K+1 (tree).

    sample_drafts (chains only): sampled requests draw the draft's tokens from its own
    processed distribution q and accept each with probability min(1, p/q), drawing the
    correction from max(0, p - q). Off (the default), drafts are the draft's argmax (or its
    top-k tree) and the target's own sample at each node decides (target-only verification).
    Both give exactly the target's distribution; greedy requests are unaffected.

    verify_lengths (chains of a proposer that estimates acceptance, the block drafters):
    confidence-budgeted verification. Each round drafts the whole chain of S, then verifies
    only its first l drafts, l one of verify_lengths or S, the one whose expected tokens
    over the batch's rows per unit of cost is highest (`jspec.loop.budget`): a row's
    expected tokens at l are 1 plus its drafts' estimated survival (the cumulative product
    of the draft's probability of each drafted token) up to l. verify_costs: the relative
    cost of a round at each of verify_lengths and then S (a round's time at that chain
    length, e.g. from `python -m jspec bench`'s ms a round); with verify_cost_rows (the
    numbers of running rows the costs were measured at, ascending) one such tuple of costs
    for each, interpolated linearly at the round's active rows (clamped at the ends), so
    one SpecConfig suits every occupancy of a serving engine. Output is unchanged (every
    length verifies exactly); only the work a round does moves. survival_power: each
    draft's probability is raised to this power before it estimates acceptance (a
    calibration: below 1 for an underconfident drafter; 0.5 fits the bundled DFlash
    drafter, docs/benchmarks.md).
    """

    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int | None = None
    sample_drafts: bool = False
    verify_lengths: tuple[int, ...] = ()
    verify_costs: tuple = ()
    verify_cost_rows: tuple[int, ...] = ()
    survival_power: float = 1.0

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
        if not isinstance(self.sample_drafts, bool):
            raise ValueError(f"SpecConfig.sample_drafts must be a bool, got {self.sample_drafts!r}")
        if self.sample_drafts and self.topk != 1:
            raise ValueError("SpecConfig.sample_drafts is for chains (topk=1); trees verify their top-k "
                             f"drafts with the target's own samples, got topk={self.topk}")
        if n - 1 > self.max_candidates:
            raise ValueError(f"num_draft_tokens-1 = {n - 1} exceeds the {self.max_candidates} candidates "
                             f"that num_steps={self.num_steps}, topk={self.topk} produce (K + (S-1)K^2)")
        self._check_budget()

    def _check_budget(self):
        """verify_lengths, verify_costs, verify_cost_rows and survival_power (the class
        docstring), kept as tuples and floats."""
        lengths, costs, rows = self.verify_lengths, self.verify_costs, self.verify_cost_rows
        if not all(isinstance(v, (tuple, list)) for v in (lengths, costs, rows)):
            raise ValueError(f"SpecConfig.verify_lengths, verify_costs and verify_cost_rows must be sequences, got "
                             f"{lengths!r}, {costs!r} and {rows!r}")
        as_costs = lambda c: tuple(float(v) if _is_number(v) else v for v in c) if isinstance(c, (tuple, list)) else c  # noqa: E731
        lengths, rows = tuple(lengths), tuple(rows)
        costs = tuple(as_costs(c) for c in costs) if rows else as_costs(costs)
        for name, value in (("verify_lengths", lengths), ("verify_costs", costs), ("verify_cost_rows", rows)):
            object.__setattr__(self, name, value)
        power = self.survival_power
        if not (_is_number(power) and 0 < power < float("inf")):
            raise ValueError(f"SpecConfig.survival_power must be a positive number, got {power!r}")
        object.__setattr__(self, "survival_power", float(power))
        if not lengths:
            if power != 1.0 or costs or rows:
                raise ValueError("SpecConfig.verify_costs, verify_cost_rows and survival_power configure "
                                 "confidence-budgeted verification: they need verify_lengths (the shorter chains "
                                 "a round may verify)")
            return
        if self.topk != 1:
            raise ValueError(f"SpecConfig.verify_lengths is for chains (topk=1), got topk={self.topk}")
        S = self.num_steps
        if not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v < S for v in lengths) \
                or list(lengths) != sorted(set(lengths)):
            raise ValueError(f"SpecConfig.verify_lengths must be ascending distinct ints in [1, num_steps) = "
                             f"[1, {S}), got {lengths}")
        if rows and (not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in rows)
                     or list(rows) != sorted(set(rows))):
            raise ValueError(f"SpecConfig.verify_cost_rows must be ascending distinct ints >= 1, got {rows}")
        n = len(lengths) + 1
        ok = lambda c: (isinstance(c, tuple) and len(c) == n  # noqa: E731
                        and all(_is_number(v) and 0 < v < float("inf") for v in c))
        if not (all(ok(c) for c in costs) and len(costs) == len(rows) if rows else ok(costs)):
            each = f"one tuple for each of verify_cost_rows {rows}, each of " if rows else ""
            raise ValueError(f"SpecConfig.verify_costs must hold {each}{n} positive costs (a round's at each of "
                             f"verify_lengths {lengths}, then at num_steps={S}), got {costs}")

    @property
    def cost_table(self) -> tuple[tuple[int, ...], tuple[tuple[float, ...], ...]]:
        """(row counts [R], costs [R][C]) of confidence-budgeted verification: the
        verify_costs measured at each of verify_cost_rows (one set at any row count when
        none are given)."""
        if self.verify_cost_rows:
            return self.verify_cost_rows, self.verify_costs
        return (1,), (self.verify_costs,)

    @property
    def verify_choices(self) -> tuple[int, ...]:
        """The chain lengths a round may verify: verify_lengths, then S."""
        return self.verify_lengths + (self.num_steps,)

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @property
    def max_candidates(self) -> int:
        S, K = self.num_steps, self.topk
        return K + (S - 1) * K * K


KV_CACHE_DTYPES = (None, "float8_e4m3fn")  # `CacheConfig.dtype`


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """KV cache: `kind` 'dense' (a region per request) or 'paged' (a shared page pool).

    max_len: tokens a request may hold (prompt + generated); None sizes it from the call.
    page_size: tokens per page (paged only, any value >= 1).
    num_pages: pages in the pool (paged only); None gives every request max_len worth.
    dtype: what the keys and values are stored in; None: the model's dtype;
    "float8_e4m3fn": FP8 (E4M3), half a bf16 cache's bytes. Keys and values are rounded
    to E4M3 as they are written (clipped to +-448, scale 1: vLLM's default when a
    checkpoint carries no calibrated scales; a checkpoint's per-layer `k_scale` /
    `v_scale`, or those `jspec.calibrate_kv_scales` measures, divide them first,
    `cache.kv.cached_attention`) and widened where attention reads them: by
    the GQA decode and row-invariant kernels block by block (half a bf16 cache's reads),
    by the jnp references elsewhere (MLA latent caches, whose kernels do not take FP8, and
    with which the row-invariant mode is off). Every cache kind: GQA (Llama, Qwen2/3,
    Mistral, the full-attention layers of Qwen3.5/Qwen3-Next) and MLA latent rows
    (DeepSeek; V3.2's indexer keys stay in the model's dtype).
    """

    kind: str = "dense"
    max_len: int | None = None
    page_size: int = 16
    num_pages: int | None = None
    dtype: str | None = None

    def __post_init__(self):
        if self.kind not in ("dense", "paged"):
            raise ValueError(f"CacheConfig.kind must be 'dense' or 'paged', got {self.kind!r}")
        if self.dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"CacheConfig.dtype must be one of {KV_CACHE_DTYPES}, got {self.dtype!r}")
        for name in ("max_len", "num_pages"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"CacheConfig.{name} must be a positive int or None, got {v!r}")
        if not isinstance(self.page_size, int) or isinstance(self.page_size, bool) or self.page_size < 1:
            raise ValueError(f"CacheConfig.page_size must be an int >= 1, got {self.page_size!r}")
