"""Where a round of the bundled pair spends its GPU kernels: a profiler trace of one run
per program, each kernel attributed to the loop phase (`jax.named_scope` in
`loop.round_step`: draft, verify, accept, commit, extend) whose operations it fuses, from
the compiled HLO's metadata. Kernels per round and their time, per phase.

Run: PYTHONPATH=. python3 benchmarks/round_kernels.py [S,K,N ...]   (default: 4,1,5)
"""
from __future__ import annotations

import collections
import glob
import os
import re
import sys
import tempfile

import jax

from benchmarks.common import Runner, env_info, save_json
from jspec import bundle
from jspec.bench import parse_spec

PROMPT = "def fibonacci(n):\n"
PHASES = ("draft", "verify", "accept", "commit", "extend")


def op_phases(hlo_text: str) -> dict:
    """HLO instruction name -> the loop phase of its op_name (or 'loop' inside the while
    body outside every phase, 'outside' elsewhere)."""
    out = {}
    for m in re.finditer(r"%([\w.\-]+) = [^\n]*?op_name=\"([^\"]+)\"", hlo_text):
        parts = m.group(2).split("/")
        phase = next((p for p in parts if p in PHASES), "loop" if "while" in m.group(2) else "outside")
        out[_norm(m.group(1))] = phase
    return out


def _norm(name: str) -> str:
    """Kernel and instruction names compared: '.' and '-' in HLO names are '_' in kernels."""
    return re.sub(r"[.\-]", "_", name)


def traced_kernels(run):
    """-> [(kernel name, hlo op or None, us)] of the GPU kernels while run() runs."""
    from jax.profiler import ProfileData
    d = tempfile.mkdtemp()
    jax.profiler.start_trace(d)
    res = run()
    jax.profiler.stop_trace()
    path = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0]
    rows = []
    for plane in ProfileData.from_file(path).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "Stream" not in line.name:
                continue
            for e in line.events:
                rows.append((e.name, None, e.duration_ns / 1e3))
    return res, rows


def phase_table(r, max_new: int, hlo_name: str | None = None) -> dict:
    hlo = r.prog.executable.as_text()
    if hlo_name:
        from benchmarks.common import out_dir
        with open(os.path.join(out_dir(), hlo_name), "w") as f:
            f.write(hlo)
    phases = op_phases(hlo)
    r.run(max_new)
    (_, res), rows = traced_kernels(lambda: r.run(max_new))
    rounds = max(res.stats.rounds)
    table = collections.defaultdict(lambda: [0, 0.0])
    unmapped = collections.Counter()
    names = collections.defaultdict(collections.Counter)
    for name, op, us in rows:
        ph = phases.get(_norm(op or name)) or phases.get(_norm(re.sub(r"_impl$", "", name)))
        if ph is None:
            ph = "unmapped"
            unmapped[name[:80]] += 1
        table[ph][0] += 1
        table[ph][1] += us
        names[ph][name[:60]] += 1
    return {"rounds": rounds, "tokens_per_round": res.timing["new_tokens"] / rounds,
            "phases": {k: {"kernels_per_round": v[0] / rounds, "us_per_round": v[1] / rounds}
                       for k, v in sorted(table.items())},
            "unmapped": {k: n / rounds for k, n in unmapped.most_common(12)},
            "kernels": {ph: {k: n / rounds for k, n in c.most_common()} for ph, c in names.items()}}


def main():
    specs = [parse_spec(a) for a in sys.argv[1:]] or [parse_spec("4,1,5")]
    pair = bundle.load("eagle3", dtype=None if jax.default_backend() == "gpu" else "float32")
    res = {"env": env_info(), "prompt": PROMPT}
    res["plain"] = phase_table(Runner(pair.with_draft(None), [PROMPT], 160), 160)
    for spec in specs:
        res[f"{spec.num_steps},{spec.topk},{spec.num_draft_tokens}"] = phase_table(Runner(pair, [PROMPT], 160, spec=spec), 160,
                                                                             f"hlo_{spec.num_steps}x{spec.topk}.txt")
    for k, v in res.items():
        if isinstance(v, dict) and "phases" in v:
            print(k, f"{v['tokens_per_round']:.2f} tokens/round;",
                  "; ".join(f"{p} {x['kernels_per_round']:.1f} kernels {x['us_per_round']:.1f} us"
                            for p, x in v["phases"].items()))
            print("  unmapped:", v["unmapped"])
    print("saved", save_json(f"round_kernels_{jax.default_backend()}.json", res))


if __name__ == "__main__":
    main()
