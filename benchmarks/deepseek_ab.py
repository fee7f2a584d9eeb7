"""Batch-1 decoding of a DeepSeek-V2-Lite-shaped model with few layers (random bf16
weights, context 1k) under several settings in one process on the same weights
(`jspec.clear_caches()` between): ms a step from two run lengths' difference, a 16-token
run's time (median of 5) and what of it is not its steps, and whether the tokens equal the
first setting's. Settings change module constants of the kernels
before the program is traced:
- default: the code as it is;
- splits_half: the expert kernel aims at half as many programs (fewer K splits);
- stages4: the expert kernel's loads 4 stages deep;
- bn64: the expert kernel's tiles 64 columns wide; down_bn128: the gated second
  product's 128 wide (64 by default); norm_inside: the post-attention norm in the
  router's and expert kernel's prologues instead of XLA's kernels before the MLP;
- out32, out64: `mla_output` with 32 or 64 columns a program; out_warps8: with 8 warps;
  chunk128: its latent in 128-wide chunks whatever the splits;
- first_bn128: one token's first expert product 128 columns wide whatever its input width;
- matvec4: `matvec` (and so `mla_inputs`) for products of up to 4 rows (verify), not 1;
- rows64: the MLA kernel with 64 query rows a program whatever the rows in all (16 up to
  `mla_decode.SMALL_ROWS_MAX` by default);
- cache_write_off: the latent row written to the cache by XLA's update after
  `mla_inputs` instead of by `mla_inputs` itself;
- grouped_off: prefill's routed experts through `jax.lax.ragged_dot` instead of the
  grouped kernel (`kernels.moe_grouped`);
  few_pairs_ragged: `jax.lax.ragged_dot` below 4 pairs an expert (the grouped kernel's
  earlier threshold);
- graphs_off: the loop compiled with XLA's default command buffers instead of the
  family's (`deepseek.GPU_XLA_OPTIONS`: graphs over the while loop and its conditionals,
  and of single kernels); graphs_loop_only: the loop's graphs without single kernels';
  no_graphs: no command buffers at all;
- xla_rows: one-row dense products as XLA's (padded) products instead of `matvec`;
- splits2x: twice the target programs; min2: K splits of 2 chunks allowed (more
  splits for the dense products); matvec_auto: `matvec` with the expert kernel's default
  tiles (128 columns, K splits by its rule) instead of its own.
Settings join with "+" (no_graphs+grouped_off: both). The script only uses what older
versions of jspec also have, so the same file measures an older checkout for a side-by-side comparison (its settings other than default may not
apply there and are then skipped).

Run: PYTHONPATH=. python3 benchmarks/deepseek_ab.py [layers] [setting ...]   (default 6 default;
DEEPSEEK_AB_BATCH: the batch, default 1)
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import jspec
from benchmarks.common import Runner, env_info, random_params, save_json
from benchmarks.deepseek_h200 import V2_LITE, prompts

GRAPHS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"  # command buffer kinds
SETTINGS = {  # name -> [(module, constant, value)]
    "default": [],
    "splits_half": [("jspec.kernels.moe_experts", "TARGET_PROGRAMS", 264)],
    "stages4": [("jspec.kernels.moe_experts", "DEFAULT_STAGES", 4)],
    "bn64": [("jspec.kernels.moe_experts", "DEFAULT_BLOCK_N", 64)],
    "down_bn128": [("jspec.kernels.moe_experts", "GATED_BLOCK_N", 128)],
    "norm_inside": [("jspec.models.deepseek", "MLP_NORM_IN_KERNEL", True)],
    "out32": [("jspec.kernels.mla_output", "DEFAULT_BLOCK_N", 32)],
    "out64": [("jspec.kernels.mla_output", "DEFAULT_BLOCK_N", 64)],
    "xla_rows": [("jspec.kernels.moe_experts", "MATVEC_MAX_ROWS", 0)],
    "splits2x": [("jspec.kernels.moe_experts", "TARGET_PROGRAMS", 1056)],
    "min2": [("jspec.kernels.moe_experts", "MIN_SPLIT_CHUNKS", 2)],
    "first_bn128": [("jspec.kernels.moe_experts", "NARROW_FIRST_MIN_DIN", 1 << 30)],
    "chunk128": [("jspec.kernels.mla_output", "SPLIT_TILE", 0)],
    "out_warps8": [("jspec.kernels.mla_output", "DEFAULT_WARPS", 8)],
    "matvec4": [("jspec.kernels.moe_experts", "MATVEC_MAX_ROWS", 4)],
    "rows64": [("jspec.kernels.mla_decode", "SMALL_ROWS_MAX", 0)],
    "cache_write_off": [("jspec.models.deepseek", "CACHE_WRITE_IN_KERNEL", False)],
    "grouped_off": [("jspec.kernels.moe_grouped", "KERNEL", False)],
    "few_pairs_ragged": [("jspec.kernels.moe_grouped", "MIN_PAIRS_PER_EXPERT", 4)],
    "graphs_off": [("jspec.models.deepseek", "GPU_XLA_OPTIONS", {})],
    "graphs_loop_only": [("jspec.models.deepseek", "GPU_XLA_OPTIONS", {"xla_gpu_enable_command_buffer": GRAPHS})],
    "no_graphs": [("jspec.models.deepseek", "GPU_XLA_OPTIONS", {"xla_gpu_enable_command_buffer": ""})],
    "matvec_auto": [("jspec.kernels.moe_experts", "MATVEC_BLOCK_N", 128),
                    ("jspec.kernels.moe_experts", "MATVEC_SPLITS", None)],
}


def changes_of(name: str):
    """A setting's changes; "a+b" combines settings a and b."""
    return [c for part in name.split("+") for c in SETTINGS[part]]


def apply(changes):
    """Sets the constants (a list of changes, or a setting's name); -> the previous values,
    or None when a module or constant is missing."""
    if isinstance(changes, str):
        changes = changes_of(changes)
    kept = []
    for mod, name, value in changes:
        try:
            m = importlib.import_module(mod)
        except ImportError:
            return None
        if not hasattr(m, name):
            return None
        kept.append((m, name, getattr(m, name)))
    for (m, name, _), (_, _, value) in zip(kept, changes):
        setattr(m, name, value)
    return kept


def main(layers: int, names: list[str]):
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    tag = os.environ.get("JSPEC_BENCH_TAG", commit or "tree")
    cfg = V2_LITE.replace(num_layers=layers)
    target = random_params(cfg)
    batch = int(os.environ.get("DEEPSEEK_AB_BATCH", "1"))
    res = {"env": env_info(), "layers": layers, "batch": batch, "code": tag, "rows": []}
    tokens = None
    for name in names:
        kept = apply(name)
        if kept is None:
            print(f"{name}: not in this version of jspec, skipped", flush=True)
            continue
        jspec.clear_caches()
        r = Runner(target, prompts(batch, cfg.vocab_size), 112)
        per = r.per_round(16, 112, reps=3)[0]
        runs = sorted(r.run(16)[0] for _ in range(5))
        out = r.run(16)[1].tokens
        tokens = tokens or out
        fixed = runs[2] - 16 * per  # a run's time beside its steps (inputs, prefill, outputs)
        row = {"setting": name, "ms_per_step": round(per * 1e3, 4), "same_tokens": out == tokens,
               "ms_16_token_runs": [round(t * 1e3, 2) for t in runs], "ms_fixed_per_run": round(fixed * 1e3, 2)}
        res["rows"].append(row)
        print(f"[{tag}] {layers} layers, batch {batch}, {name}: {per * 1e3:.3f} ms/step, a 16-token run "
              f"{runs[2] * 1e3:.1f} ms (median of 5; {fixed * 1e3:.1f} ms beside the steps), tokens "
              f"{'identical' if out == tokens else 'DIFFER'}", flush=True)
        for m, const, value in kept:
            setattr(m, const, value)
    save_json(f"deepseek_ab_{tag}_{layers}l" + ("" if batch == 1 else f"_b{batch}") + ".json", res)
    print(json.dumps(res["rows"]))


if __name__ == "__main__":
    args = sys.argv[1:]
    n = int(args.pop(0)) if args and args[0].isdigit() else 6
    main(n, args or ["default"])
