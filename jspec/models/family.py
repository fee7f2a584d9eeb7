"""The target-family protocol: what the loop, loading and export need of a model family.

A family (Llama-architecture GQA decoders today; DeepSeek MLA + MoE and hybrid linear
attention later) is one object whose methods take the family's frozen config first:
it parses its config from a Hugging Face config.json, converts weights from and to
Hugging Face tensors, runs forward over T tokens with its cache, and names the cache kind
it needs. The loop never asks which family it runs. A new family adds its own files and
one line in `jspec.models.FAMILIES`.
"""
from __future__ import annotations

from typing import Any, ClassVar
from jspec.tuning import DEFAULT_TUNING


# GPUs (substrings of `jax.Device.device_kind`) where the row-invariant mode of large
# targets (Llama-3.1-8B and DeepSeek-V2-Lite shapes at batch 1) was measured within 3% of
# the step and round without it (docs/benchmarks.md). An H200 paid 5.8% a step of the 8B
# shape (jax 0.11.2, 2026-11-26); other GPUs were not measured.
ROW_INVARIANT_CHEAP_GPUS = ("H100",)


def row_invariant_measured_cheap(device) -> bool:
    """Whether large targets take the row-invariant mode by default on `device`: a GPU
    of `ROW_INVARIANT_CHEAP_GPUS`, or a backend without GPU kernels (the CPU's products
    are row-invariant already, so the mode costs nothing there)."""
    return device.platform != "gpu" or any(kind in device.device_kind for kind in ROW_INVARIANT_CHEAP_GPUS)


class TargetFamily:
    """Base class of a family; `config_type` is the frozen config class it owns and
    `architectures` the Hugging Face `architectures` entries it loads."""

    config_type: ClassVar[type]
    architectures: ClassVar[tuple[str, ...]]
    # Whether the family's projections may keep FP8 weights in device memory (every one it
    # builds with `Tensors.linear` is a `models.layers.Linear`; `jspec.quantization`);
    # otherwise FP8 checkpoints are dequantized on the host.
    fp8_weights: ClassVar[bool] = False
    # Whether its routed experts' stacks may stay FP8 too, with their scales (DeepSeek's:
    # `Tensors.experts(keep_fp8=True)`, read by the expert kernels); otherwise dequantized.
    fp8_experts: ClassVar[bool] = False

    def config_from_hf(self, cfg_json: dict, dtype: str | None) -> Any:
        """config.json dict -> the family's config (dtype None: the checkpoint's)."""
        raise NotImplementedError

    def weights_from_hf(self, tensors: dict, cfg, where: str) -> Any:
        """Hugging Face tensors {name: numpy array} -> weights (a pytree); `where` names the
        directory in errors. Missing, extra and mis-shaped tensors fail naming them."""
        raise NotImplementedError

    def weights_to_hf(self, cfg, weights) -> tuple[dict, dict]:
        """-> (config.json dict, {tensor name: numpy array}) that transformers loads."""
        raise NotImplementedError

    def init_weights(self, cfg, key) -> Any:
        """Random weights (for tests and benchmarks)."""
        raise NotImplementedError

    def cache_kind(self, cfg) -> Any:
        """The cache kind (jspec.cache) whose caches `forward` reads and writes."""
        raise NotImplementedError

    def forward(self, cfg, weights, tokens, cache, meta, capture: tuple[int, ...] = (), tuning=DEFAULT_TUNING):
        """tokens [B,T] -> (hidden [B,T,D] after the final norm, {layer i: its input
        [B,T,D]} for the `capture` layers (i = num_layers: the last layer's output), cache).
        tuning (`jspec.tuning.Tuning`): how the layers and kernels compute, passed down."""
        raise NotImplementedError

    def logits(self, cfg, weights, hidden, tuning=DEFAULT_TUNING):
        """hidden [..., D] -> float32 logits [..., V] (tuning as `forward`)."""
        raise NotImplementedError

    def embed(self, cfg, weights, tokens):
        """tokens [...] -> input embeddings [..., D] (EAGLE heads share the target's)."""
        raise NotImplementedError

    def row_invariant_problem(self, cfg, tuning) -> str | None:
        """Why this target cannot run with `Tuning.row_invariant` (None: it can)."""
        return f"not available for {type(self).__name__} targets yet (Llama and DeepSeek targets have it)"

    def row_invariant_by_default(self, cfg, batch: int, device) -> bool:
        """What `Tuning.row_invariant=None` (auto) becomes for this target on one device
        (where `row_invariant_problem` has none), for programs of `batch` rows (the plan's
        batch bucket: plain and speculative programs of one batch agree) on `device` (a
        `jax.Device`: `row_invariant_measured_cheap`)."""
        return False

    def gpu_xla_options(self, cfg) -> dict:
        """XLA options this family's loop programs are compiled with on a GPU, under a
        tuning's `xla_options` (which win where both set one; `Tuning.family_xla_options`
        False leaves these out), see `jspec.tuning.Tuning.compiler_options`."""
        return {}

    def split(self, cfg, weights, n: int) -> tuple[Any, Any, Any]:
        """The model for n devices (`jspec.sharding`) -> (config, weights, PartitionSpec
        tree); weights may hold `jspec.tensors.HostParam`s, which must stay unread."""
        raise ValueError(f"{type(self).__name__}: this family's targets cannot be split over devices yet")
