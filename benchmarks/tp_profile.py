"""Per-GPU kernels of the Llama-3.1-8B-shaped batch-1 decode step, split over 2 GPUs and
then on a mesh of 1 (H200s, random bf16 weights): for each, ms per step and, from a
profile of 40 steps, kernels and kernel time per step and the top kernels of GPU 0.

Run: PYTHONPATH=. python3 benchmarks/tp_profile.py [top]   (output: results/tp_8b_kernels_h200.log)
"""
from __future__ import annotations

import collections
import glob
import os
import sys
import tempfile
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (see tp_h200.py)

import jax  # noqa: E402
from jax.profiler import ProfileData  # noqa: E402

from benchmarks.bench_8b import prompts  # noqa: E402
from benchmarks.common import LLAMA31_8B, Runner  # noqa: E402
from benchmarks.tp_h200 import random_split_params  # noqa: E402


def plane_kernels(plane):
    """({(stream, kernel): [calls, us]}, us some kernel runs) of one GPU's trace."""
    stats, spans = collections.defaultdict(lambda: [0, 0.0]), []
    for line in plane.lines:
        if "Stream" not in line.name:
            continue
        for e in line.events:
            stats[(line.name.split("(")[0].strip(), e.name)][0] += 1
            stats[(line.name.split("(")[0].strip(), e.name)][1] += e.duration_ns / 1e3
            spans.append((e.start_ns, e.start_ns + e.duration_ns))
    busy, end = 0.0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            busy, end = busy + b - a, b
        elif b > end:
            busy, end = busy + b - end, b
    return stats, busy / 1e3


def main(top: int):
    for n in (2, 1):
        t0 = time.time()
        params = random_split_params(LLAMA31_8B, n, with_head=False)
        print("init", n, round(time.time() - t0), "s", flush=True)
        r = Runner(params, prompts(1), 80)
        per = r.per_round(16, 80, reps=2)[0]
        r.run(40)
        d = tempfile.mkdtemp()
        jax.profiler.start_trace(d)
        secs, res = r.run(40)
        jax.profiler.stop_trace()
        steps = max(res.stats.rounds)
        print(f"== n={n}: {per * 1e3:.3f} ms/step, profiled run {secs * 1e3 / steps:.3f} ms/step", flush=True)
        pd = ProfileData.from_file(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0])
        for plane in pd.planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            stats, busy = plane_kernels(plane)
            calls = sum(c for c, _ in stats.values())
            print(f" {plane.name}: {calls / steps:.0f} kernels/step, kernel us/step "
                  f"{sum(t for _, t in stats.values()) / steps:.0f}, busy {busy / steps:.0f} us/step")
            if plane.name.endswith(":0"):
                for (stream, name), (c, t) in sorted(stats.items(), key=lambda kv: -kv[1][1])[:top]:
                    print(f"   {t / steps:8.1f} us {c / steps:6.1f}x mean {t / c:6.1f}  [{stream}] {name[:90]}")
        del r, params


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 45)
