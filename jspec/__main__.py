"""`python -m jspec [PROMPT]`: speculative code generation with the bundled models.

Loads the bundled target (a small model trained on the Python standard library) with its
EAGLE-3 head, continues PROMPT (greedy, or sampled with --temperature/--top-p/--top-k),
and prints the text, the mean accepted length per round and tokens/s, next to plain
decoding of the same target with the same settings.
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jspec", description=__doc__.splitlines()[0])
    ap.add_argument("prompt", nargs="?", default="def fibonacci(n):\n")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--draft", choices=["eagle3", "standalone"], default="eagle3")
    ap.add_argument("--steps", type=int, default=4, help="draft steps per round (a chain)")
    ap.add_argument("--topk", type=int, default=1, help="branches per draft step (>1: a tree)")
    ap.add_argument("--tokens", type=int, default=None, help="tree nodes verified per round (topk > 1)")
    ap.add_argument("--dtype", default=None, help="float32 (default on CPU) or bfloat16")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 (the default): greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample-drafts", action="store_true",
                    help="sampled requests draw the drafts from the draft's distribution (chains)")
    args = ap.parse_args(argv)

    import jax

    import jspec
    from jspec import bundle

    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else None)
    params = bundle.load(args.draft, dtype=dtype)
    spec = jspec.SpecConfig(num_steps=args.steps, topk=args.topk, num_draft_tokens=args.tokens,
                            sample_drafts=args.sample_drafts)
    kw = dict(max_new_tokens=args.max_new_tokens, stop_token_ids=[], temperature=args.temperature,
              top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    jspec.generate(params, args.prompt, spec=spec, **kw)  # compile once, then time
    out = jspec.generate(params, args.prompt, spec=spec, **kw)
    jspec.generate(params.with_draft(None), args.prompt, **kw)
    plain = jspec.generate(params.with_draft(None), args.prompt, **kw)
    print(args.prompt + out.text)
    print("-" * 72)
    print(f"speculative ({args.draft}, S={spec.num_steps}, K={spec.topk}, N={spec.num_draft_tokens}): "
          f"{len(out.tokens)} tokens, mean accepted length {out.stats.mean_accept_length:.2f}, "
          f"{out.timing['tokens_per_s']:.0f} tokens/s")
    print(f"plain decoding: {plain.timing['tokens_per_s']:.0f} tokens/s "
          f"(speed-up {out.timing['tokens_per_s'] / plain.timing['tokens_per_s']:.2f}x); "
          f"outputs {'identical' if plain.tokens == out.tokens else 'differ'}"
          + ("" if args.temperature == 0 else " (sampled: the same distribution; target-only verification draws "
                                              "the same tokens for the same seed up to rounding)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
