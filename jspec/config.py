"""Frozen, hashable configuration dataclasses (usable as static jit arguments).

`ModelConfig` describes a Llama-family decoder as Hugging Face defines it (Llama 2/3/3.1,
Qwen2/2.5, Qwen3, Mistral); its family (`jspec.models.llama`) parses it from config.json.
Draft kinds are their own frozen classes (`jspec.drafts`). `SpecConfig` and `CacheConfig`
are the user-facing knobs of generation; `Tuning` holds the settings that tune kernels and
compilation (part of every compile key, passed down as arguments), one group of tiles per
kernel (`ExpertTiles`, `GroupedTiles`, `RouteTiles`, `MlaInputsTiles`, `MlaDecodeTiles`,
`MlaOutputTiles`, `AttentionTiles`, `GatedDeltaTiles`, `RowAttentionTiles`, `RowMatmulTiles`).
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
    """

    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int | None = None
    sample_drafts: bool = False

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


# --------------------------------------------------------------------------- tuning
# Settings that change how a program is computed, never what it computes. Each group is one
# kernel's (its module named in the docstring); a kernel's public function takes its group
# as `tiles=` (None: these defaults) and its single tiles as keyword arguments, which win.
# The defaults are the measured best; the figures are the measurements behind them.


@dataclasses.dataclass(frozen=True)
class ExpertTiles:
    """`jspec.kernels.moe.experts`: the expert kernel (decode and verification's routed and
    shared experts, DeepSeek's dense MLP and router product at a few rows) and `matvec`, the
    same kernel for few-row dense products (`models.llama.Linear(row_kernel=True)`).

    Measured on the H200 (benchmarks/kernels.py moe, device time of the routed
    experts, bf16): 3.3 TB/s at V3 N=1, 3.5-3.7 TB/s at N=4..16, 1.9 TB/s at V2-Lite N=1.
    Sizes tuned one by one gained 2-9% at most (BK=32, 4 warps, 4 stages at V3 N>=4)."""

    block_n: int = 128  # output columns per program
    block_k: int = 64  # weight rows per loop step
    num_warps: int = 2  # beat 4 warps by 5-20% on every product measured
    num_stages: int = 3
    # The gated second product (`routed_experts`) of one token takes 64-column tiles:
    # V2-Lite's 8 experts 15.7 us instead of 17.7 with 128 (matvec_configs, a probe at 3bf4f68
    # down, H200); the first product stays at 128 (26.0 us against 27.8 with 64). At 4 tokens
    # (32 pairs) 64 made an MTP round 5% slower (benchmarks/deepseek.py mtp),
    # so more tokens keep block_n.
    gated_block_n: int = 64
    # The first product of one token takes gated_block_n-wide tiles too when its input is at
    # least this wide: DeepSeek-V3's 9 experts [7168, 4096] 144 us against 168 us with 128
    # (3.7 against 3.1 TB/s, mla_b1_configs, a probe at 3bf4f68, H200); V2-Lite's [2048, 2816]
    # keep block_n.
    narrow_first_min_din: int = 4096
    target_programs: int = 528  # four programs per SM on an H200 (132 SMs): more K splits below that
    min_split_chunks: int = 4  # a K split walks at least this many chunks
    # DeepSeek's dense MLP at a few rows runs as one wide expert; its second product keeps
    # 128-column tiles (H200: 15.8 us against 18.0 with gated_block_n 64,
    # benchmarks/profiler.py decode --model v2lite).
    dense_down_block_n: int = 128
    matvec_max_rows: int = 1  # `matvec` runs the kernel for products of at most this many rows
    # `matvec`'s tiles: 64 columns a program and 16 K splits were the fastest of 21 tilings
    # for V2-Lite's 2048 x 3648 and 2048 x 2048 products (matvec_configs, a probe at 3bf4f68);
    # matvec_splits None: from target_programs and min_split_chunks.
    matvec_block_n: int = 64
    matvec_splits: int | None = 16
    # Larger weights stay XLA's products, which stream them faster (DeepSeek-V3's 16384 x
    # 7168 output projection: 0.44 ms a V3 layer through `matvec`, 0.36 through XLA; below
    # 10M elements XLA pads the row, see `Tuning.two_row_elements`).
    matvec_max_elements: int = 10_000_000


@dataclasses.dataclass(frozen=True)
class GroupedTiles:
    """`jspec.kernels.moe.grouped`: the grouped expert kernel (prefill and batches of at
    least one (token, expert) pair an expert)."""

    # False: `grouped` takes `jax.lax.ragged_dot` on a GPU at any size (benchmark A/Bs).
    kernel: bool = True
    # The kernel runs from this many pairs an expert on (so wherever the model groups
    # pairs: it does from E pairs on); below, ragged_dot. Kernel time a call in the
    # profiler, H200 (benchmarks/kernels.py moe): V2-Lite's routed experts at 32 tokens (3
    # pairs an expert) 322 us (the two products 175 + 90 us, 3.7-3.8 TB/s over the distinct
    # experts) against 367 for ragged_dot; V3 at 32 tokens (one pair an expert) 3.6 ms
    # against 7.8 (wall). Wall-clock timings of these calls outside a CUDA graph
    # (moe_paths, a probe at 3bf4f68) favour ragged_dot at 16-32 V2-Lite tokens only through the
    # grouped path's 47 kernel launches against 13, which the decode loop's command
    # buffers do not pay.
    min_pairs_per_expert: int = 1
    # Rows a tile: small_block_m while the pairs are few against the experts (little
    # padding: each group's tiles read its expert once), large_block_m from
    # large_from_pairs_per_expert pairs an expert on.
    small_block_m: int = 16
    large_block_m: int = 64
    large_from_pairs_per_expert: int = 16
    block_n: int = 128  # output columns a program
    block_k: int = 64  # input rows a loop step
    num_warps: int = 4
    num_stages: int = 3


@dataclasses.dataclass(frozen=True)
class RouteTiles:
    """`jspec.kernels.moe.route`: where the router product runs (the routing kernel itself
    has no tiles)."""

    kernel_product_tokens: int = 16  # up to this many tokens the router product runs in the expert kernel
    block_k: int = 64  # its rows a program (K splits: the router weight is read by many SMs)


@dataclasses.dataclass(frozen=True)
class MlaInputsTiles:
    """`jspec.kernels.mla.inputs`: query absorption, RoPE and the cache row of one token."""

    block_c: int = 64  # latent values of q_lat a program: [64, Dn] of W_UK
    num_warps: int = 4


@dataclasses.dataclass(frozen=True)
class MlaDecodeTiles:
    """`jspec.kernels.mla.decode`: MLA attention over the latent cache (flash decoding).

    On the H200 (benchmarks/kernels.py mla, bf16, 2026-11-23) 64 query rows a program
    beat 32 by 20-28% at H = 128 with batch 32 or T = 16 (fewer row blocks re-reading the
    keys, bigger tensor-core tiles); block_k 32 with 3 stages was slower."""

    block_rows: int = 64  # query rows a program above small_rows_max rows in all (float32: half)
    # Up to this many query rows in all (B*T*H) a program takes 16 rows (the smallest
    # tensor-core M): at batch 1 on the H200 (mla_b1_configs, a probe at 3bf4f68 rows, 1k context)
    # the MLA kernel took 6.2 against 12.7 us for 4 tokens of 16 heads, 6.2 against 9.0 for
    # 2, 8.1 against 13.2 for 1 token of 128 heads and 17.7 against 26.6 for 4 of them,
    # with 64 rows a program.
    small_rows_max: int = 512
    block_k: int = 64  # key slots a block, 16-bit caches (float32: half)
    target_programs: int = 264  # about two waves of programs on an H200 (132 SMs)
    num_warps: int | None = None  # None: 4, or 8 for row tiles above 16 x 512
    num_stages: int = 2


@dataclasses.dataclass(frozen=True)
class MlaOutputTiles:
    """`jspec.kernels.mla.output`: the merge of the MLA kernel's key splits and W_UV."""

    block_n: int = 16  # output columns a program: 16 x Dc=512 float32 weights, 64 a thread
    num_warps: int = 4
    # A program per (query row, column tile) re-reads its head's W_UV tile for every token:
    # (B*T) x 2 MB of L2 reads a layer at DeepSeek's shapes. Past this many tokens XLA's
    # batched product (W_UV read once) is faster: on the H200 a batch-32 V2-Lite step took
    # 12.93 ms with the kernel, 12.29 without (docs/experiments.md).
    kernel_max_tokens: int = 16
    # The latent is walked in chunks of split_tile // NSP values (at least min_chunk, at
    # most Dc), NSP the splits as a power of two: the [NSP, chunk] float32 tile of the
    # splits stays about split_tile values. At V2-Lite's batch-1 decode (19 splits, NSP 32:
    # one 512-wide chunk) that took 3.5 us against 6.3 us with 128-wide chunks
    # (mla_b1_configs, a probe at 3bf4f68, H200); 128 or more splits keep 128-wide chunks.
    split_tile: int = 16384
    min_chunk: int = 128
    # `mla_output(ordered=True)` (`kernels.row.mla`) unrolls its walk over up to this many
    # splits (their loads issued together) and loops over more; the same sums either way.
    # Unrolled: V2-Lite's 4-layer batch-1 profile took the kernel from 17.9 to 11.6 us a step
    # (H100, 2026-11-26, docs/experiments.md).
    unroll_splits: int = 32


@dataclasses.dataclass(frozen=True)
class AttentionTiles:
    """`jspec.kernels.attention.decode`: GQA attention over the KV cache (flash decoding)."""

    block_k: int = 128  # batch-1 decode on the H200: 128 beat 64, 32 and 16 (docs/benchmarks.md)
    target_programs: int = 256  # about two waves of programs on an H200 (132 SMs)
    max_rows: int = 64  # query rows per program (more: split over programs, keeps registers in check)
    num_warps: int | None = None  # None: 4, or 8 for row tiles above 32 x 128
    num_stages: int = 2


@dataclasses.dataclass(frozen=True)
class RowAttentionTiles:
    """`jspec.kernels.row.attention` (`Tuning.row_invariant`): block_k positions a key
    block, split_blocks blocks a split (splits cover fixed position ranges, so these tiles,
    not the batch, decide a row's sums; plain and speculative programs must share them)."""

    block_k: int = 128  # the 8B shape's batch-1 step on an H100: (128, 1) 5.706 ms against 5.738
    split_blocks: int = 1  # with (128, 2), 5.733 with (64, 2), 5.739 with (64, 1) (docs/benchmarks.md)
    num_warps: int = 4
    num_stages: int = 2
    unroll_splits: int = 32  # the merge's walk over the splits written out up to this many
    pack_tokens: bool = True  # GQA: several tokens' heads in a program's 16 rows (`row_attention`); on an
    # H100 the 8B shape's 16-node tree round then costs 1.5% over the default's (10.7% unpacked: docs/benchmarks.md)
    pack_min_splits: int = 4  # ... where the cache holds at least this many splits (`row_attention.packs`): the
    # bundled pair's first run (2 splits) ran 5943 tokens/s unpacked, 5614 packed (H100, docs/benchmarks.md)
    merge_block_d: int = 32  # `row_attention`'s split merge: head dimensions a program


@dataclasses.dataclass(frozen=True)
class RowNormTiles:
    """`jspec.kernels.row.norm` (`Tuning.row_invariant`): warps a row's program."""

    num_warps: int | None = None  # None: 16 for rows of at least wide_d columns, else 4
    wide_d: int = 4096  # on an H100, 16 warps were faster for the 8B shape's 4096 (docs/benchmarks.md)

    def warps_for(self, d: int) -> int:
        """Warps a program takes for rows of d columns."""
        if self.num_warps is not None:
            return self.num_warps
        return 16 if d >= self.wide_d else 4


@dataclasses.dataclass(frozen=True)
class RowMatmulTiles:
    """`jspec.kernels.row.matmul` (`Tuning.row_invariant`): columns and K chunk a program,
    the programs a row block aims for (K splits follow from the weight's shape and this)."""

    block_n: int = 128
    block_k: int = 64
    target_programs: int = 264
    wide_n: int = 16384  # weights of at least this many columns (gate/up, LM heads), where wide_block_n
    wide_block_n: int = 256  # divides N: programs this wide and one K split while the column tiles
    one_wave: int = 132  # fit one wave of this many programs (the H100's SMs), else two splits
    num_warps: int = 4
    wide_num_warps: int = 8  # the wide tiles' programs: the 8B step 5.665 ms against 5.687 with 4, within noise
    # in the products alone (docs/experiments.md, fifth pass)
    num_stages: int = 3


_XLA_VALUE = (bool, int, str)


@dataclasses.dataclass(frozen=True)
class GatedDeltaTiles:
    """Tiles of the gated delta kernels (`jspec.kernels.gated_delta.kernels`; part of a compile key: frozen, hashable). The
    defaults are the fastest of `benchmarks/qwen35.py gated_delta`'s sweep on an H200 (jax 0.11.2,
    2026-11-26; docs/benchmarks.md) among the variants within 2e-5 of the reference.

    *_block_v: Dv columns per program (powers of two; verify and prefill >= 16, Triton's
    smallest product); *_warps, *_stages: Triton's num_warps and num_stages (stages > 1
    pipeline the loads of a loop's next step; prefill_stages applies to 16-bit q, k, v
    only: float32 inputs overflowed the shared memory at 3); prefill_chunk: tokens per
    chunk (16, 32 or 64); prefill_blocked: the chunk's solve as FLA's (16-row diagonal
    blocks inverted together, then merged by products) rather than row by row over the
    whole chunk; prefill_w: the prep kernel also writes W = X diag(beta exp(G)) K, so that
    the scan's u = X (beta V) - W S (one product on the chain from one chunk's state to
    the next, not two); verify_split: verification in two kernels (per head: everything
    that does not read the state, as o = P S0 + R; then per Dv tile: the product with the
    state); verify_state_xla: that product by XLA, float32; precision: the matrix
    products' ("ieee"; "tf32x3", "bf16x6", "bf16x3": float32 split into 3 TF32 or 6 or 3
    bf16 products; "tf32"; interpret mode takes float32's). bf16x3 keeps about 16 bits
    of each operand (relative errors about 6e-6 against the float32 rule, measured) at a
    fraction of tf32x3's time; the step kernel has no products (exact float32)."""
    step_block_v: int = 64
    step_warps: int = 4
    step_stages: int = 1
    verify_block_v: int = 32
    verify_warps: int = 4
    verify_stages: int = 1
    verify_split: bool = True
    verify_state_xla: bool = False
    verify_prep_warps: int = 2
    prefill_chunk: int = 64
    prefill_block_v: int = 32
    prefill_warps: int = 4
    prefill_stages: int = 3
    prefill_blocked: bool = True
    prefill_w: bool = False
    chunk_prep_warps: int = 4
    precision: str = "bf16x3"


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Settings that change how a program is computed, never what it computes: kernel tiles,
    kernel-prologue switches, padding rules and XLA options. Part of the compile key (a
    field of the loop's `Plan`) and passed down as arguments to the models and kernels, as
    JAX's Pallas ops take tiles as keyword arguments. The defaults are the measured best
    (docs/benchmarks.md); benchmarks compare settings by passing tunings, e.g.
    `Tuning(experts=ExpertTiles(num_stages=4), cache_write_in_kernel=False)`.

    One group of tiles per kernel (see each class): experts, grouped, route, mla_inputs,
    mla_decode, mla_output, attention, gated_delta, row_attention, row_mla, row_matmul. The rest:

    mlp_norm_in_kernel: DeepSeek's post-attention norm runs in the prologues of the kernels
    that read the MLP's input (the router product, the first expert product) instead of as
    XLA's kernels first. On: in one H200 call on the same weights, V2-Lite's 6-layer step
    0.567 ms with it against 0.581-0.583 without, the V3 layer shape 0.348 against 0.372 ms
    a layer (with the first expert product 64 columns wide; at 128 it had cost V3 0.416
    against 0.349 ms).

    cache_write_in_kernel: `kernels.mla.inputs` writes a decoding token's latent row into
    the cache itself (where it runs: one row, no q_lora_rank) instead of an update kernel
    after it (on the H200 that update was a 1.2 us kernel a layer at batch 1).

    two_row_elements, two_row_backends: XLA's GPU compiler rewrites a one-row product whose
    operands hold fewer than 10M elements (`IsMatrixMultiplicationTooSmallForRewriting`) as
    an elementwise multiply that writes the whole [K, N] product and a reduction that reads
    it back: 18.5 us instead of 6.2 for DeepSeek-V2-Lite's 2048x3072 query projection. With
    a second row of zeros it stays a matrix product. Weights of [lo, hi) elements get that
    padding on these backends (`models.llama.pad_one_row`; docs/benchmarks.md, "One-row
    products"); jax 0.11 has no option to turn the rewrite off.

    cpu_matmul_max_rows: float32 products of up to this many rows run jspec's native loops
    on the CPU (`kernels.cpu.matmul`); above (prefill) XLA's GEMM is the faster one.

    recurrent_commit: how a verification leaves the linear layers' states for the commit
    (`jspec.cache.recurrent`): "replay" (the nodes' inputs; the commit replays the accepted
    path) or "checkpoint" (every node's states; the commit copies one). Both commit the
    same states; docs/benchmarks.md says why replay is the default.

    row_invariant: every product, the LM head and attention compute a row (one token) with
    the same operations in the same order whatever other rows share the pass
    (`kernels.row.matmul`, `kernels.row.attention`; XLA compiles the programs with
    xla_allow_excess_precision off), so a verification node's logits equal the decode
    step's at its position bit for bit and greedy speculative output equals plain greedy
    output on a GPU too. Plain and speculative programs must both have it. Llama and
    DeepSeek (MLA + MoE; `kernels.row.mla`, the expert kernel with one token's tiles)
    targets on one device (True elsewhere is refused); a prompt's passes (prefill, prompt
    chunks) keep XLA's products and attention. None
    (the default): on where the family measured it within 3% of the step without
    (`TargetFamily.row_invariant_by_default`, given the plan's batch and the device: Llama
    targets up to hidden size 1024 at every batch, e.g. the bundled pair, and larger ones
    at batch 1 (the 8B shape's step and rounds 1.7-2.3% dearer on an H100); DeepSeek
    targets up to batch 4; the large targets only on GPUs of
    `models.family.ROW_INVARIANT_CHEAP_GPUS`, the H100: an H200 paid 5.8% an 8B step), off
    elsewhere; docs/benchmarks.md gives its cost. On a CPU it changes
    nothing: jspec's CPU products are row-invariant already and the kernels do not run.

    xla_options: (name, value) pairs of XLA options for the loop's programs on a GPU, on top
    of the target family's own (`TargetFamily.gpu_xla_options`), which family_xla_options
    False leaves out (XLA's defaults but for xla_options); see
    `jspec.kernels.dispatch.compiler_options`. A dict is taken as its items."""

    experts: ExpertTiles = ExpertTiles()
    grouped: GroupedTiles = GroupedTiles()
    route: RouteTiles = RouteTiles()
    mla_inputs: MlaInputsTiles = MlaInputsTiles()
    mla_decode: MlaDecodeTiles = MlaDecodeTiles()
    mla_output: MlaOutputTiles = MlaOutputTiles()
    attention: AttentionTiles = AttentionTiles()
    gated_delta: GatedDeltaTiles = GatedDeltaTiles()
    row_attention: RowAttentionTiles = RowAttentionTiles()
    # `kernels.row.mla`: one 64-key block a split (V2-Lite, 4 layers, batch 1 on an H100: 0.532
    # ms a step against 0.535 with two blocks and 0.561 with four; docs/benchmarks.md)
    row_mla: RowAttentionTiles = RowAttentionTiles(block_k=64, split_blocks=1)
    row_matmul: RowMatmulTiles = RowMatmulTiles()
    row_norm: RowNormTiles = RowNormTiles()
    row_invariant: bool | None = None
    mlp_norm_in_kernel: bool = True
    cache_write_in_kernel: bool = True
    two_row_elements: tuple[int, int] = (1 << 20, 10_000_000)
    two_row_backends: tuple[str, ...] = ("gpu",)
    cpu_matmul_max_rows: int = 32
    recurrent_commit: str = "replay"
    xla_options: tuple[tuple[str, bool | int | str], ...] = ()
    family_xla_options: bool = True

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if dataclasses.is_dataclass(f.default) and not isinstance(v, type(f.default)):
                raise TypeError(f"Tuning.{f.name} must be of type {type(f.default).__name__}, got {v!r}")
            if isinstance(f.default, bool) and not isinstance(v, bool):
                raise TypeError(f"Tuning.{f.name} must be a bool, got {v!r}")
        if self.row_invariant is not None and not isinstance(self.row_invariant, bool):
            raise TypeError(f"Tuning.row_invariant must be True, False or None (auto), got {self.row_invariant!r}")
        if self.recurrent_commit not in ("replay", "checkpoint"):
            raise ValueError(f"Tuning.recurrent_commit must be 'replay' or 'checkpoint', got {self.recurrent_commit!r}")
        opts = self.xla_options
        if isinstance(opts, dict):
            opts = tuple(opts.items())
        if not isinstance(opts, (tuple, list)) or not all(
                isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], _XLA_VALUE)
                for p in opts):
            raise TypeError(f"Tuning.xla_options must be (name, value) pairs with bool, int or str values, "
                            f"got {self.xla_options!r}")
        object.__setattr__(self, "xla_options", tuple((k, v) for k, v in opts))
        lo_hi = self.two_row_elements
        if not (isinstance(lo_hi, tuple) and len(lo_hi) == 2 and all(isinstance(v, int) for v in lo_hi)):
            raise TypeError(f"Tuning.two_row_elements must be a pair of ints (lo, hi), got {lo_hi!r}")
        if not (isinstance(self.two_row_backends, tuple) and all(isinstance(b, str) for b in self.two_row_backends)):
            raise TypeError(f"Tuning.two_row_backends must be a tuple of backend names, got {self.two_row_backends!r}")

    def replace(self, **kw) -> "Tuning":
        return dataclasses.replace(self, **kw)


DEFAULT_TUNING = Tuning()
