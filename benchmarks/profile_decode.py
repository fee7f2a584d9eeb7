"""Where the time of one decode step goes: a profiler trace of the generation loop for
the Llama-3.1-8B shape (random bf16 weights), GPU kernels grouped by name.

Also times a step (two run lengths, as bench_8b.py) and saves the compiled program's HLO,
so kernel names can be read back to the operations they fuse. JSPEC_BENCH_TAG names the
output files.

Run: PYTHONPATH=. python3 benchmarks/profile_decode.py [batch] [S,K,N]
(with S,K,N: rounds of speculative decoding with a random EAGLE-3-shaped head instead)
"""
from __future__ import annotations

import collections
import glob
import os
import sys
import tempfile

import jax

from benchmarks.bench_8b import prompts
from benchmarks.common import Runner, bench_tag, model_for, out_dir, save_json


def kernel_spans(trace_dir: str):
    """GPU kernel events of a trace -> ({name: [calls, us]}, sorted [(start_ns, end_ns)])."""
    from jax.profiler import ProfileData
    path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
    pd = ProfileData.from_file(path)
    stats = collections.defaultdict(lambda: [0, 0.0])
    spans = []
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "Stream" not in line.name:
                continue
            for e in line.events:
                stats[e.name][0] += 1
                stats[e.name][1] += e.duration_ns / 1e3
                spans.append((e.start_ns, e.start_ns + e.duration_ns))
    return stats, sorted(spans)


def busy_and_gaps(spans):
    """-> (us some kernel runs, [us of each idle stretch between kernels])."""
    busy, end, gaps = 0.0, None, []
    for a, b in spans:
        if end is not None and a > end:
            gaps.append((a - end) / 1e3)
        if end is None or a > end:
            busy, end = busy + b - a, b
        elif b > end:
            busy, end = busy + b - end, b
    return busy / 1e3, gaps


def kernel_table(trace_dir: str):
    """-> ({kernel name: [calls, us]}, GPU busy us, window us from first to last kernel)."""
    stats, spans = kernel_spans(trace_dir)
    busy, _ = busy_and_gaps(spans)
    return stats, busy, _window(spans)


def _window(spans) -> float:
    """us from the first kernel's start to the last kernel's end."""
    return (max(b for _, b in spans) - spans[0][0]) / 1e3 if spans else 0.0


def main(batch: int = 1, shape: str = ""):
    tag = bench_tag(shape)
    suffix = f"_b{batch}{'_' + tag if tag else ''}"
    target, spec = model_for(shape)
    new = 40
    r = Runner(target, prompts(batch), 144, spec=spec)
    per, _, _ = r.per_round(16, 144)
    with open(os.path.join(out_dir(), f"hlo{suffix}.txt"), "w") as f:
        f.write(r.prog.executable.as_text())
    r.run(new)
    d = tempfile.mkdtemp()
    jax.profiler.start_trace(d)
    secs, res = r.run(new)
    jax.profiler.stop_trace()
    stats, spans = kernel_spans(d)
    busy_us, gaps = busy_and_gaps(spans)
    window_us = _window(spans)
    steps = max(res.stats.rounds)
    rows = sorted(((v[1], v[0], k) for k, v in stats.items()), reverse=True)
    total = sum(v[1] for v in stats.values())
    print(f"batch {batch} {tag}: {per * 1e3:.3f} ms/step (timed); {steps} steps in {secs * 1e3:.1f} ms; kernels total {total / 1e3:.1f} ms, "
          f"GPU busy {busy_us / 1e3:.1f} ms of a {window_us / 1e3:.1f} ms window; "
          f"{sum(v[0] for v in stats.values()) / max(steps, 1):.0f} kernels/step")
    print(f"{'us/step':>9} {'calls/step':>10}  name")
    for t, n, name in rows[:40]:
        print(f"{t / steps:9.1f} {n / steps:10.1f}  {name[:110]}")
    gaps = sorted(gaps, reverse=True)
    big = [g for g in gaps if g > 2.0]
    print(f"idle gaps between kernels: {len(gaps)} in all, {sum(gaps) / 1e3:.2f} ms; {len(big)} over 2 us "
          f"({sum(big) / 1e3:.2f} ms); largest (us): {[round(g, 1) for g in gaps[:12]]}; per step over 2 us: "
          f"{sum(big[2:]) / max(steps, 1):.1f} us (the two largest, around the prefill, left out)")
    save_json(f"profile_decode{suffix}.json", {"steps": steps, "run_s": secs, "ms_per_step": per * 1e3, "busy_us": busy_us,
                                                 "window_us": window_us, "gaps_us": [round(g, 2) for g in gaps if g > 0.5],
                                                 "kernels": [(name, n, t) for t, n, name in rows]})


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1, sys.argv[2] if len(sys.argv) > 2 else "")
