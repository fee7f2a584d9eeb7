"""Where a batch-1 decode step of the DeepSeek-V2-Lite shape goes: a profiler trace of the
generation loop (random bf16 weights, `layers` decoder layers: the first dense, the rest
MoE), GPU kernels grouped by name, per step.

Run: PYTHONPATH=. python3 benchmarks/deepseek_profile.py [layers] [setting]   (default 4 default;
settings as `benchmarks/deepseek_ab.py`). Under the family's command buffers (the default)
the trace shows none of the kernels inside the loop's CUDA graph, only the prefill's: take
the setting no_graphs to see the decode step's kernels (its step is about 8% slower).
"""
from __future__ import annotations

import sys
import tempfile

import jax

from benchmarks.deepseek_ab import apply
from benchmarks.common import Runner, random_params, save_json
from benchmarks.deepseek_h200 import V2_LITE, prompts
from benchmarks.profile_decode import busy_and_gaps, kernel_spans


def main(layers: int, setting: str = "default"):
    apply(setting)
    cfg = V2_LITE.replace(num_layers=layers)
    r = Runner(random_params(cfg), prompts(1, cfg.vocab_size), 144)
    per, _, _ = r.per_round(16, 144, reps=2)
    r.run(40)
    d = tempfile.mkdtemp()
    jax.profiler.start_trace(d)
    secs, res = r.run(40)
    jax.profiler.stop_trace()
    stats, spans = kernel_spans(d)
    busy_us, gaps = busy_and_gaps(spans)
    steps = max(res.stats.rounds)
    rows = sorted(((v[1], v[0], k) for k, v in stats.items()), reverse=True)
    kernels = sum(v[0] for v in stats.values()) / steps
    kernel_us = sum(v[1] for v in stats.values())
    print(f"{layers} layers: {per * 1e3:.3f} ms/step timed; {kernels:.0f} kernels/step; GPU busy "
          f"{busy_us / steps:.0f} us/step (kernel time {kernel_us / steps:.0f}: more when streams overlap); "
          f"idle gaps {sum(gaps) / steps:.0f} us/step")
    for t, n, name in rows[:30]:
        print(f"{t / steps:9.1f} us {n / steps:6.1f}x  {name[:100]}")
    save_json(f"deepseek_profile_{layers}l_{setting}.json", {"layers": layers, "setting": setting, "ms_per_step": per * 1e3, "kernels_per_step": kernels,
                                                  "busy_us_per_step": busy_us / steps,
                                                  "kernels": [(name, n / steps, t / steps) for t, n, name in rows]})


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4, *sys.argv[2:3])
