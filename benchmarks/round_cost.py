"""A round's fixed cost: the time of one speculative round of the bundled pair minus its
model work (the target's forward over the N nodes and the draft's forwards: S-1 draft
steps and the draft-extend over the committed tokens), on this machine, for the CLI's
default chain. The model work is timed as separate jitted forwards over the loop's own
caches; the round from two generation lengths through one compiled program.

On a GPU it also traces one run of each program: kernels per step and per round, the
time some kernel runs, and the idle time between kernels (launch and host waits).

Run: PYTHONPATH=. python3 benchmarks/round_cost.py [--dtype float32] [--steps 4] [--topk K --tokens N]
"""
from __future__ import annotations

import argparse
import tempfile

import jax
import jax.numpy as jnp

import jspec
from benchmarks.common import Runner, env_info, median_time, save_json
from jspec import bundle
from jspec.cache.layout import causal_mask
from jspec.loop import loop
from jspec.loop.propose import _draft_step

PROMPT = "def fibonacci(n):"


def target_verify(plan, tw, st, N: int):
    """The target's forward over the first N tokens of the loop state `st` (as a round's
    verification): -> (float32 logits [B, N, V], draft features, target cache)."""
    B, L = plan.batch, st.L
    pos = L[:, None] + jnp.arange(N)[None]
    meta = plan.layout.meta(st.pages, positions=pos, prefix_len=L, local_mask=causal_mask(jnp.full((B,), N), N),
                            write_valid=jnp.ones((B, N), bool))
    hidden, aux, tcache = plan.family.forward(plan.target, tw, st.tokens[:, :N], st.tcache, meta,
                                              plan.draft.target_layers)
    return plan.family.logits(plan.target, tw, hidden), plan.draft.target_features(hidden, aux), tcache


def model_work(prog) -> dict:
    """Seconds of the target's verify forward (N nodes) and the draft's forwards of a round."""
    plan, (tw, dw) = prog.plan, prog.weights
    inp = jax.device_put(prog.inputs())
    st = jax.jit(loop.start, static_argnums=0)(plan, tw, dw, inp)
    B, N, S = plan.batch, plan.N, plan.S
    L = st.L
    live = jnp.ones((B,), bool)

    @jax.jit
    def verify(tw, st):
        return target_verify(plan, tw, st, N)

    @jax.jit
    def draft_steps(tw, dw, st):
        tok, h, dcache, out = st.first_tokens, st.draft_hidden[:, None], st.dcache, []
        one = jnp.ones((B, 1, 1), bool)
        for j in range(1, S):
            pos = L + plan.lag + j - 1
            logits, hs, dcache = _draft_step(plan, tw, dw, st.pages, dcache, tok, h, pos[:, None], pos, one, live)
            tok, h = jnp.argmax(logits, axis=-1).astype(jnp.int32), hs
            out.append(tok)
        return out, dcache

    T = S + 1 + plan.lag
    feats = verify(tw, st)[1]
    feats = None if feats is None else jnp.pad(feats, ((0, 0), (0, max(T - N, 0)), (0, 0)))[:, :T]

    @jax.jit
    def extend(tw, dw, st, feats):
        meta = plan.layout.meta(st.pages, positions=L[:, None] + jnp.arange(T)[None], prefix_len=L,
                                local_mask=causal_mask(jnp.full((B,), T), T), write_valid=jnp.ones((B, T), bool))
        hidden, dcache = plan.draft.forward(plan.target, tw, dw, st.tokens[:, :T], feats, st.dcache, meta, True)
        return plan.draft.logits(plan.target, tw, dw, hidden[:, -1]), dcache

    parts = {"target verify": median_time(verify, tw, st), "draft steps": median_time(draft_steps, tw, dw, st)}
    parts["draft extend"] = median_time(extend, tw, dw, st, feats)
    return parts


def trace(r, max_new: int) -> dict:
    """GPU kernels of one run: per round (or step) kernels, busy us and idle us."""
    from benchmarks.profile_decode import busy_and_gaps, kernel_spans
    r.run(max_new)
    d = tempfile.mkdtemp()
    jax.profiler.start_trace(d)
    _, res = r.run(max_new)
    jax.profiler.stop_trace()
    stats, spans = kernel_spans(d)
    busy, gaps = busy_and_gaps(spans)
    n = max(res.stats.rounds)
    gaps = sorted(gaps)[:-2]  # the two largest: around the prefill
    return {"rounds": n, "kernels_per_round": sum(v[0] for v in stats.values()) / n,
            "busy_us_per_round": busy / n, "idle_us_per_round": sum(gaps) / n}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--max-new", type=int, default=160)
    args = ap.parse_args()
    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    pair = bundle.load("eagle3", dtype=dtype)
    spec = jspec.SpecConfig(num_steps=args.steps, topk=args.topk, num_draft_tokens=args.tokens)
    res = {"env": env_info(), "dtype": dtype, "spec": [spec.num_steps, spec.topk, spec.num_draft_tokens]}
    plain = Runner(pair.with_draft(None), [PROMPT], args.max_new)
    step, _, _ = plain.per_round(16, args.max_new)
    r = Runner(pair, [PROMPT], args.max_new, spec=spec)
    per, rounds, toks = r.per_round(16, args.max_new)
    work = model_work(r.prog) if spec.topk == 1 else {}
    model = sum(work.values())
    res.update(plain_step_ms=step * 1e3, round_ms=per * 1e3, tokens_per_round=toks / rounds,
               model_work_ms={k: v * 1e3 for k, v in work.items()}, fixed_ms=(per - model) * 1e3 if work else None,
               speedup=(toks / rounds) * step / per)
    if jax.default_backend() == "gpu":
        res["trace"] = {"plain step": trace(plain, args.max_new), "round": trace(r, args.max_new)}
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()}, flush=True)
    tag = f"_{spec.num_steps}x{spec.topk}x{spec.num_draft_tokens}" if spec.topk > 1 else ""
    print("saved", save_json(f"round_cost_{jax.default_backend()}{tag}.json", res))


if __name__ == "__main__":
    main()
