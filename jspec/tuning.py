"""`Tuning`: the settings that change how a program is computed, never what it computes
(kernel tiles, kernel-prologue switches, padding rules, XLA options). One frozen, hashable
dataclass, part of every compile key (a field of the loop's `Plan`) and passed down as an
argument to the models and kernels.

It sits above the kernels and below the caches and models: each kernel's tile dataclass is
defined beside the kernel (`jspec.kernels.moe.experts.ExpertTiles`, ...), its public function
takes it as `tiles=` (None: that class's defaults) and its single tiles as keyword arguments,
which win; a `Tuning` holds one group per kernel. The defaults are the measured best; the
figures beside each tile are the measurements behind it.
"""
from __future__ import annotations

import dataclasses

import jax

from jspec.kernels.attention.decode import AttentionTiles
from jspec.kernels.cpu import matmul as cpu_matmul
from jspec.kernels.fp8.matmul import Fp8Tiles
from jspec.kernels.fp8.mosaic import MosaicTiles
from jspec.kernels.fp8.w8a8 import W8a8Tiles
from jspec.kernels.gated_delta.kernels import GatedDeltaTiles
from jspec.kernels.mla.decode import MlaDecodeTiles
from jspec.kernels.mla.inputs import MlaInputsTiles
from jspec.kernels.mla.output import MlaOutputTiles
from jspec.kernels.moe.experts import ExpertTiles
from jspec.kernels.moe.grouped import GroupedTiles
from jspec.kernels.moe.route import RouteTiles
from jspec.kernels.row import mla as row_mla
from jspec.kernels.row.attention import RowAttentionTiles
from jspec.kernels.row.matmul import RowMatmulTiles
from jspec.kernels.row.norm import RowNormTiles

_XLA_VALUE = (bool, int, str)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Settings that change how a program is computed, never what it computes: kernel tiles,
    kernel-prologue switches, padding rules and XLA options. Part of the compile key (a
    field of the loop's `Plan`) and passed down as arguments to the models and kernels, as
    JAX's Pallas ops take tiles as keyword arguments. The defaults are the measured best
    (docs/benchmarks.md); benchmarks compare settings by passing tunings, e.g.
    `Tuning(experts=ExpertTiles(num_stages=4), cache_write_in_kernel=False)`.

    One group of tiles per kernel (each class beside its kernel, with the measurements behind
    its defaults): experts (`kernels.moe.experts.ExpertTiles`), fp8 (`kernels.fp8.matmul`;
    its mosaic_rows sends few rows on a Hopper GPU to the Mosaic GPU kernel), fp8_mosaic
    (`kernels.fp8.mosaic.MosaicTiles`), fp8_w8a8 (`kernels.fp8.w8a8.W8a8Tiles`: FP8 x FP8
    products of 65 rows or more on Hopper, the rows rounded to E4M3, min_rows=0 turns it
    off; and MoE experts grouped by expert from 16 pairs an expert, min_pairs_per_expert=0
    turns that off; docs/benchmarks.md), grouped (`kernels.moe.grouped`),
    route (`kernels.moe.route`), mla_inputs, mla_decode, mla_output (`kernels.mla.inputs`,
    `.decode`, `.output`), attention (`kernels.attention.decode`), gated_delta
    (`kernels.gated_delta.kernels`), row_attention, row_mla (`kernels.row.attention`'s
    `RowAttentionTiles`; row_mla's default `kernels.row.mla.MLA_TILES`), row_matmul, row_norm
    (`kernels.row.matmul`, `kernels.row.norm`). The rest:

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
    padding on these backends (`models.layers.pad_one_row`; docs/benchmarks.md, "One-row
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

    prefill_block: `generate`, `compile` and `stream` prefill a prompt longer than this in
    blocks of this many tokens, in a loop inside the program (`jspec.loop.rows.prefill_rest`):
    activations and attention scores bounded by the block, and one program for every prompt
    length up to the plan's (`make_plan`). 0: whole prompts in one pass, whatever
    max_batched_tokens says. Every cache kind takes a prompt in blocks (GQA, MLA, and the
    hybrid's linear layers, which continue their states block to block). The serving
    engine has its own block, `Engine(prefill_chunk=)`.

    max_batched_tokens: the most prompt tokens one such pass takes over its B rows (vLLM's
    max_num_batched_tokens; the engine's is `Engine(max_batched_tokens=)`): a row's block
    is at most max_batched_tokens // B (a multiple of 16, at least 16;
    `jspec.loop.plan.row_block`), so a batch of prompts prefills in bounded memory too.
    0: no bound but prefill_block.

    xla_options: (name, value) pairs of XLA options for the loop's programs, on a GPU on top
    of the target family's own (`TargetFamily.gpu_xla_options`), which family_xla_options
    False leaves out (XLA's defaults but for xla_options); off the GPU those not named
    xla_gpu_* (the CPU's code generation, say `xla_backend_optimization_level`); see
    `compiler_options`. A dict is taken as its items."""

    experts: ExpertTiles = ExpertTiles()
    fp8: Fp8Tiles = Fp8Tiles()
    fp8_mosaic: MosaicTiles = MosaicTiles()
    fp8_w8a8: W8a8Tiles = W8a8Tiles()
    grouped: GroupedTiles = GroupedTiles()
    route: RouteTiles = RouteTiles()
    mla_inputs: MlaInputsTiles = MlaInputsTiles()
    mla_decode: MlaDecodeTiles = MlaDecodeTiles()
    mla_output: MlaOutputTiles = MlaOutputTiles()
    attention: AttentionTiles = AttentionTiles()
    gated_delta: GatedDeltaTiles = GatedDeltaTiles()
    row_attention: RowAttentionTiles = RowAttentionTiles()
    row_mla: RowAttentionTiles = row_mla.MLA_TILES
    row_matmul: RowMatmulTiles = RowMatmulTiles()
    row_norm: RowNormTiles = RowNormTiles()
    row_invariant: bool | None = None
    mlp_norm_in_kernel: bool = True
    cache_write_in_kernel: bool = True
    two_row_elements: tuple[int, int] = (1 << 20, 10_000_000)
    two_row_backends: tuple[str, ...] = ("gpu",)
    cpu_matmul_max_rows: int = cpu_matmul.MAX_ROWS
    recurrent_commit: str = "replay"
    prefill_block: int = 2048
    max_batched_tokens: int = 16384
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
        if not (isinstance(self.prefill_block, int) and self.prefill_block >= 0 and self.prefill_block % 16 == 0):
            raise ValueError(f"Tuning.prefill_block must be 0 or a positive multiple of 16, got {self.prefill_block!r}")
        if not (isinstance(self.max_batched_tokens, int) and self.max_batched_tokens >= 0):
            raise ValueError(f"Tuning.max_batched_tokens must be 0 or positive, got {self.max_batched_tokens!r}")
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

    def compiler_options(self, family_options: dict | None = None) -> dict[str, bool | int | str]:
        """The XLA options the loop's programs are compiled with: on a GPU backend the target
        family's (`TargetFamily.gpu_xla_options`; left out where `family_xla_options` is
        False) updated with `xla_options`; elsewhere the `xla_options` not named xla_gpu_*.
        On a GPU `row_invariant` adds xla_allow_excess_precision=False: XLA may otherwise
        keep a bf16 rounding in float32 where its fusion, which follows the shapes, lets it.
        Returns a new dict."""
        if jax.default_backend() != "gpu":
            return {k: v for k, v in self.xla_options if not k.startswith("xla_gpu_")}
        base = dict(family_options or {}) if self.family_xla_options else {}
        if self.row_invariant:
            base["xla_allow_excess_precision"] = False
        return base | dict(self.xla_options)


DEFAULT_TUNING = Tuning()
