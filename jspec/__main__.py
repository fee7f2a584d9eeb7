"""`python -m jspec [PROMPT]`: speculative code generation with the bundled models.

    python -m jspec [PROMPT] [--target DIR] [--draft NAME|DIR] [--steps S --topk K --tokens N]
                    [--temperature T --top-p P --top-k K --seed S --sample-drafts] [--dtype D] [--quantization fp8]
    python -m jspec bench [--target DIR --draft DIR] [--batch B ...] [--spec S,K,N ...]
                          [--prompts FILE] [--max-new-tokens N] [--repeats R]
    python -m jspec bench serve [--target DIR --draft DIR] [--rates R ...] [--spec S,K,N|adaptive ...]
                                [--requests N] [--max-batch B] [--max-new-tokens N] [--prompts FILE]
                                [--prefill-chunk C]
    python -m jspec serve [--target DIR|ID --draft NAME|DIR|ID|mtp|ngram|none] [--host H] [--port P]
                          [--max-batch B] [--max-len L] [--max-new-tokens N] [--spec S,K,N|adaptive]
                          [--prefill-chunk C] [--max-num-batched-tokens N] [--constraint-states N] [--dtype D]
                          [--quantization fp8] [--kv-cache-dtype auto|fp8] [--served-model-name NAME]
                          [--chat-template FILE|STRING] [--api-key KEY] [--request-timeout S]
                          [--max-logprobs K] [--log-level LEVEL]

Loads the bundled target (a small model trained on the Python standard library) with its
EAGLE-3 head and its DFlash block drafter (timed side by side, on a GPU with the head's tree
(8, 2, 16) too; the fastest writes the text),
or your own local target and draft, continues PROMPT (greedy, or sampled with
--temperature/--top-p/--top-k), and prints the text, the mean accepted length per round and
tokens/s, next to plain decoding of the same target with the same settings.

`serve` runs an OpenAI-compatible HTTP server (`jspec.serve.server`) over a continuous-
batching engine (`jspec.Engine`) until SIGINT or SIGTERM.

`bench` (only as the very first argument) times plain decoding against several chains and
trees per batch size and prints a table (`jspec.bench`). A prompt that is literally "bench"
or "serve" goes after `--`: `python -m jspec -- bench`.

Bad input (a flag's value, a missing directory, what jspec.generate refuses) is reported
as one line, `python -m jspec: error: ...`, with exit status 2.
"""
from __future__ import annotations

import argparse
import math
import os
import signal
import sys

from jspec.config import DTYPES, SpecConfig

PROG = "python -m jspec"
BUNDLED_DRAFTS = ("eagle3", "dflash", "standalone")


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr (`prog: error: ...`) and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


# ----------------------------------------------------------------------------- flag types

def _int(lo: int, hi: int | None = None):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo or (hi is not None and v >= hi):
            raise argparse.ArgumentTypeError(f"must be >= {lo}" + ("" if hi is None else f" and < {hi}")
                                             + f", got {v}")
        return v
    return parse


def _float(check, what: str):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not check(v):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return v
    return parse


def _model_dir(text: str) -> str:
    """A local model directory, or a Hugging Face hub id ('org/name': resolved at load)."""
    from jspec.loading import looks_like_hub_id
    if not os.path.isdir(text) and not looks_like_hub_id(text):
        raise argparse.ArgumentTypeError(f"no such directory: {text!r} (nor a hub id 'org/name')")
    return text


def _spec(text: str) -> SpecConfig:
    from jspec.bench import parse_spec
    try:
        return parse_spec(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _spec_or_adaptive(text: str):
    """'adaptive' -> jspec.Adaptive() (the default tiers), else `_spec`."""
    if text.strip().lower() == "adaptive":
        from jspec.serve.tiers import Adaptive
        return Adaptive()
    return _spec(text)


def _prompt_file(path: str) -> list[str]:
    from jspec.bench import read_prompts
    try:
        return read_prompts(path)
    except (OSError, UnicodeDecodeError) as err:
        raise argparse.ArgumentTypeError(f"cannot read {path!r}: {getattr(err, 'strerror', None) or err}") from None
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _compilation_cache_arg(ap: argparse.ArgumentParser):
    ap.add_argument("--compilation-cache", default=None, metavar="DIR|none",
                    help="keep compiled programs on disk, so that the next start with the same model and settings "
                         "compiles nothing (JAX's persistent compilation cache; default: $JAX_COMPILATION_CACHE_DIR, "
                         "else ~/.cache/jspec/xla; 'none': off)")


def compilation_cache(where: str | None) -> str | None:
    """Turns JAX's persistent compilation cache on at `where` (None: $JAX_COMPILATION_CACHE_DIR,
    which JAX reads itself, else ~/.cache/jspec/xla; "none": off) -> the directory."""
    import jax
    if where is None:
        if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
            return os.environ["JAX_COMPILATION_CACHE_DIR"]
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        where = os.path.join(base, "jspec", "xla")
    if where == "none":
        return None
    jax.config.update("jax_compilation_cache_dir", where)
    return where


def _model_args(ap: argparse.ArgumentParser, draft_help: str):
    ap.add_argument("--target", type=_model_dir, default=None, metavar="DIR|ID",
                    help="a Hugging Face target directory or hub id (default: the bundled target)")
    ap.add_argument("--draft", default=None, metavar="NAME|DIR",
                    help=draft_help)
    ap.add_argument("--dtype", default=None, choices=DTYPES,
                    help="weights and activations (default: float32 on CPU, else the checkpoint's)")
    ap.add_argument("--quantization", default=None, choices=["fp8"],
                    help="round the target's projection weights to block FP8 when loading (FP8 checkpoints "
                         "need no flag)")


def _load(ap: argparse.ArgumentParser, args):
    """-> (params, draft label or None); bad directories are usage errors."""
    import jax

    import jspec
    from jspec import bundle
    from jspec.drafts import EMBEDDED_DRAFTS

    draft = args.draft
    if args.target is None and draft is None:
        draft = "eagle3"
    if draft == "none":
        draft = None
    embedded = args.target is not None and draft in EMBEDDED_DRAFTS  # e.g. a DeepSeek checkpoint's own MTP layer
    named = draft == "ngram" or embedded or (args.target is None and draft in BUNDLED_DRAFTS)  # no directory
    from jspec.loading import looks_like_hub_id
    if draft is not None and not named and not os.path.isdir(draft) and not looks_like_hub_id(draft):
        why = (" ('eagle3', 'dflash' and 'standalone' name the bundled drafts, which go with the bundled target)"
               if draft in BUNDLED_DRAFTS else "")
        ap.error(f"argument --draft: no such directory: {draft!r}{why}")
    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else None)
    try:
        if args.target is None and (draft is None or draft in BUNDLED_DRAFTS):
            params = bundle.load(draft, dtype=dtype, quantization=args.quantization)
        else:
            params = jspec.load(args.target or os.path.join(bundle.bundle_path(), "target"), draft=draft,
                                dtype=dtype, quantization=args.quantization)
    except (ValueError, TypeError, OSError) as err:
        ap.error(str(err))
    return params, draft


# ----------------------------------------------------------------------------- commands

def _generate_parser() -> _Parser:
    ap = _Parser(prog=PROG, description=__doc__.splitlines()[0],
                 epilog="Benchmark: `python -m jspec bench --help`. A prompt that is literally 'bench' "
                        "goes after `--`.")
    ap.add_argument("prompt", nargs="?", default="def fibonacci(n):",
                    help="the text to continue (default: 'def fibonacci(n):', the README's first run)")
    ap.add_argument("--max-new-tokens", type=_int(1), default=160)
    _model_args(ap, "a draft directory, 'none' (plain decoding only), 'ngram' (prompt lookup in the text "
                    "itself), 'mtp' (the MTP layer in a --target DeepSeek-V3 checkpoint), or with the bundled target "
                    "'eagle3', 'dflash' or 'standalone' (default with the bundled target: eagle3 and dflash, timed "
                    "side by side; none with --target)")
    ap.add_argument("--steps", type=_int(1), default=None,
                    help="draft steps per round (default: 2 on a CPU, 5 elsewhere: the fastest chains of the "
                         "bundled pair, docs/benchmarks.md)")
    ap.add_argument("--topk", type=_int(1), default=1, help="branches per draft step (>1: a tree)")
    ap.add_argument("--tokens", type=_int(2), default=None, help="tree nodes verified per round (topk > 1)")
    ap.add_argument("--temperature", type=_float(lambda v: math.isfinite(v) and v >= 0, "finite and >= 0"),
                    default=0.0, help="0 (the default): greedy")
    ap.add_argument("--top-p", type=_float(lambda v: 0 < v <= 1, "in (0, 1]"), default=1.0)
    ap.add_argument("--top-k", type=_int(0), default=0, help="0 (the default): off")
    ap.add_argument("--seed", type=_int(0, 2 ** 31), default=0)
    ap.add_argument("--sample-drafts", action="store_true",
                    help="sampled requests draw the drafts from the draft's distribution (chains)")
    ap.add_argument("--repeats", type=_int(1), default=5,
                    help="timed runs of each program after a warm-up, alternating (median reported; default 5)")
    ap.add_argument("--row-invariant", action=argparse.BooleanOptionalAction, default=None,
                    help="row-invariant numerics (jspec.Tuning.row_invariant): speculative greedy output equals "
                         "plain greedy output bit for bit on a GPU too (default: jspec.Tuning's auto, on for "
                         "Llama targets up to hidden size 1024 such as the bundled pair, and for larger ones at "
                         "batch 1 on GPUs where it was measured within 3%%: an H100)")
    return ap


def default_steps() -> int:
    """Draft steps per round when --steps is not given: the bundled pair's fastest chains
    (docs/benchmarks.md, "The first run"). On a 2-core CPU S=2 to 4 are within the noise
    of each other and S=2 compiles and runs least; on the H200 S=5 and 6 beat S=4."""
    import jax
    return 2 if jax.default_backend() == "cpu" else 5


def default_block_steps() -> int:
    """Drafts per block for the bundled DFlash drafter when --steps is not given (block
    S + 1): its whole trained block of 16 on a GPU, where a longer block costs little; 3
    on a CPU, where each block token costs a verification its compute."""
    import jax
    return 3 if jax.default_backend() == "cpu" else 15


def first_run_trees() -> list[SpecConfig]:
    """EAGLE-3 trees the first run (the bundled pair, no shape flags) times beside the chain
    and the DFlash block: on a GPU the deep, narrow tree (8, 2, 16), the bundled pair's
    fastest shape on the first run's prompt on an H200 (2.57-2.65x plain against the chain's
    2.18-2.26x: its 16M-parameter target is bound by launches, not bytes, so a round costs
    about as much whatever its width), though not on held-out files (0.96x the chain), hence
    timed, not the default; on a CPU, where a tree's nodes cost a verification their
    compute, none."""
    import jax
    return [] if jax.default_backend() == "cpu" else [SpecConfig(num_steps=8, topk=2, num_draft_tokens=16)]


def _stream_text(params, prompt, **kw) -> None:
    """Prints the continuation as `jspec.stream` commits it."""
    import jspec
    print(prompt, end="", flush=True)
    for chunk in jspec.stream(params, prompt, **kw):
        print(chunk.text or "", end="", flush=True)
    print()


def _timed(progs, repeats: int):
    """-> [(last output, median tokens/s)] per program: a warm-up run of each, then
    `repeats` rounds that run each program once in turn, so all see the machine alike."""
    import statistics
    outs = [p.run() for p in progs]
    tps = [[] for _ in progs]
    for _ in range(repeats):
        for i, p in enumerate(progs):
            outs[i] = p.run()
            tps[i].append(outs[i].timing["tokens_per_s"])
    return [(o, statistics.median(t)) for o, t in zip(outs, tps)]


def _generate(argv) -> int:
    import jspec

    ap = _generate_parser()
    args = ap.parse_args(argv)
    try:
        spec = SpecConfig(num_steps=args.steps or default_steps(), topk=args.topk, num_draft_tokens=args.tokens,
                          sample_drafts=args.sample_drafts)
        block_spec = SpecConfig(num_steps=args.steps or default_block_steps(), topk=args.topk,
                                num_draft_tokens=args.tokens, sample_drafts=args.sample_drafts)
    except ValueError as err:
        ap.error(f"--steps/--topk/--tokens: {err}")
    params, draft = _load(ap, args)
    if draft is None:
        spec = None
    tuning = jspec.Tuning() if args.row_invariant is None else jspec.Tuning(row_invariant=args.row_invariant)
    kw = dict(max_new_tokens=args.max_new_tokens, stop_token_ids=[], temperature=args.temperature,
              top_p=args.top_p, top_k=args.top_k, seed=args.seed, tuning=tuning)
    # The first run (the bundled target, no --draft): both bundled drafters, and with no
    # shape flags the head's trees (`first_run_trees`), timed side by side; the fastest on
    # this machine writes the text.
    runs = [(draft, params, spec)]
    if args.target is None and args.draft is None:
        if bundled_dflash():
            from jspec import bundle
            runs.append(("dflash", bundle.load("dflash", dtype=params.config.dtype, quantization=args.quantization),
                         block_spec))
        if args.steps is None and args.topk == 1 and args.tokens is None:
            runs += [(draft, params, tree) for tree in first_run_trees()]
    plain_params = params.with_draft(None)
    try:  # jspec checks its arguments before compiling: a refusal is a usage error
        progs = [jspec.compile(p, args.prompt, spec=s, **kw) for _, p, s in runs]
        plain_prog = jspec.compile(plain_params, args.prompt, **kw) if draft is not None else None
    except (ValueError, TypeError) as err:
        ap.error(str(err))
    if len(runs) == 1:
        _stream_text(params, args.prompt, spec=spec, **kw)  # the text as rounds commit; then timed runs
    timed = _timed(progs + ([plain_prog] if plain_prog is not None else []), args.repeats)
    if len(runs) > 1:
        best = max(range(len(runs)), key=lambda i: timed[i][1])
        _stream_text(runs[best][1], args.prompt, spec=runs[best][2], **kw)
    print("-" * 72)
    if draft is None:
        out, tps = timed[0]
        print(f"plain decoding (no draft): {len(out.tokens)} tokens, {tps:.0f} tokens/s")
        return 0
    plain, plain_tps = timed[-1]
    for i, ((name, _, s), prog) in enumerate(zip(runs, progs)):
        out, tps = timed[i]
        used = " (the fastest here: it wrote the text)" if len(runs) > 1 and i == best else ""
        print(f"speculative ({name}, S={s.num_steps}, K={s.topk}, N={s.num_draft_tokens}): "
              f"{len(out.tokens)} tokens, mean accepted length {out.stats.mean_accept_length:.2f}, "
              f"{tps:.0f} tokens/s, speed-up {tps / plain_tps:.2f}x{used}; "
              + outputs_line(plain.tokens, out.tokens, args.temperature, prog.plan.tuning))
    print(f"plain decoding: {plain_tps:.0f} tokens/s (tokens/s: medians of {args.repeats} timed runs each)")
    return 0


def bundled_dflash() -> bool:
    """Whether the bundle holds its DFlash block drafter."""
    from jspec import bundle
    return os.path.isfile(os.path.join(bundle.bundle_path(), "dflash", "config.json"))


def outputs_line(plain: list[int], spec: list[int], temperature: float, tuning) -> str:
    """Whether the speculative output equals plain decoding's, and where not, at which
    token and why."""
    if plain == spec:
        return "outputs identical"
    i = next((j for j, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    where = f"outputs differ from token {i} of {len(plain)}"
    if temperature > 0:
        return (where + " (sampled: the same distribution; target-only verification draws the same tokens for "
                "the same seed up to rounding)")
    if not tuning.row_invariant:
        return (where + ": without row-invariant numerics a verification sums its products and attention in "
                "another order than a decode step, and a near-tie of two logits flipped there; --row-invariant "
                "makes them equal bit for bit")
    return where + ": unexpected with --row-invariant (please report it with the command)"


def _bench_parser() -> _Parser:
    from jspec.bench import DEFAULT_SPECS
    defaults = " ".join(f"{s.num_steps},{s.topk},{s.num_draft_tokens}" for s in DEFAULT_SPECS)
    ap = _Parser(prog=f"{PROG} bench",
                 description="Times plain decoding against speculative chains and trees, per batch size "
                             "(greedy, no stop tokens), and prints tau, tokens/s and the speed-up.")
    _model_args(ap, "a draft directory, 'ngram' or 'mtp' (needed with --target), or with the bundled target "
                    "'eagle3' (the default), 'dflash', 'standalone' or 'ngram'")
    ap.add_argument("--batch", type=_int(1), nargs="+", default=[1], metavar="B", help="batch sizes (default: 1)")
    ap.add_argument("--spec", type=_spec, nargs="+", default=None, metavar="S,K,N",
                    help=f"draft steps, topk, verified tokens; K=1 is a chain; a block drafter's chain may add "
                         f"'/l:cost,...,S:cost' (each round verifies the length of most expected tokens a cost, "
                         f"e.g. 15/3:1,7:1.1,15:1.3 with the ms/round of chains 3, 7, 15; costs by running rows: "
                         f"15/3:0.6,15:0.6@1+3:1.1,15:1.6@16; '^0.5' calibrates) (default: {defaults})")
    ap.add_argument("--prompts", type=_prompt_file, default=None, metavar="FILE",
                    help="one prompt per line (a line in JSON quotes may hold \\n); default: a few code prompts")
    ap.add_argument("--max-new-tokens", type=_int(1), default=64)
    ap.add_argument("--repeats", type=_int(1), default=3, help="timed passes after a warm-up (median reported)")
    return ap


def bench_serve_parser() -> _Parser:
    ap = _Parser(prog=f"{PROG} bench serve",
                 description="A serving load test: Poisson arrivals at each rate through a continuous-batching "
                             "engine, plain decoding and each speculative setting on the same arrivals; "
                             "throughput, TTFT, TPOT and latency (p50, p99).")
    _model_args(ap, "a draft directory, 'ngram' or 'mtp', or with the bundled target 'eagle3' (the default), "
                    "'dflash', 'standalone' or 'ngram'")
    ap.add_argument("--rates", type=_float(lambda v: v > 0, "a rate > 0"), nargs="+", default=[2.0, 8.0, 32.0],
                    metavar="R", help="arrival rates, requests a second (default: 2 8 32)")
    ap.add_argument("--spec", type=_spec_or_adaptive, nargs="+", default=None, metavar="S,K,N|adaptive",
                    help="speculative settings beside plain decoding, fixed or 'adaptive' (default: adaptive and "
                         "each of its tiers: 1,1,2 3,1,4 5,1,6 and the tree 3,2,6)")
    ap.add_argument("--requests", type=_int(1), default=32, help="requests a rate (default: 32)")
    ap.add_argument("--max-batch", type=_int(1), default=8)
    ap.add_argument("--max-new-tokens", type=_int(1), default=64)
    ap.add_argument("--rounds-per-chunk", type=_int(1), default=4)
    ap.add_argument("--prefill-chunk", type=_int(1), default=512,
                    help="prompt tokens a prefill pass takes (default: 512)")
    ap.add_argument("--prompts", type=_prompt_file, default=None, metavar="FILE",
                    help="one prompt per line (default: a few code prompts)")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                    help="the engines' prefix caching (default: on)")
    _compilation_cache_arg(ap)
    return ap


def _bench_inputs(ap: _Parser, argv, what: str):
    """-> (args, params, draft label, prompts) of a benchmark command."""
    from jspec.bench import BUILTIN_PROMPTS

    args = ap.parse_args(argv)
    if args.draft == "none" or (args.target is not None and args.draft is None):
        ap.error(f"{what} compares speculative decoding with plain decoding: give --draft DIR")
    params, draft = _load(ap, args)
    return args, params, draft, args.prompts or list(BUILTIN_PROMPTS)


def _bench_header(args, params, draft, detail: str) -> str:
    import jax
    dev = jax.devices()[0]
    return (f"target {args.target or 'bundled'}, draft {draft}, {params.config.dtype}; "
            f"{getattr(dev, 'device_kind', dev.platform)}, jax {jax.__version__}; {detail}")


def _bench_serve(argv) -> int:
    from jspec.serve.load import format_load_table, run_serve_bench

    ap = bench_serve_parser()
    args, params, draft, prompts = _bench_inputs(ap, argv, "bench serve")
    compilation_cache(args.compilation_cache)
    from jspec.serve.tiers import Adaptive, default_tiers

    specs = args.spec or [Adaptive(), *[t for t in default_tiers(SpecConfig(3)) if t is not None]]
    return _bench_table(ap, lambda: run_serve_bench(
        params, prompts, rates=args.rates, specs=[None, *specs], requests=args.requests,
        max_new_tokens=args.max_new_tokens, max_batch=args.max_batch, rounds_per_chunk=args.rounds_per_chunk,
        prefill_chunk=args.prefill_chunk, prefix_caching=args.enable_prefix_caching,
        progress=lambda line: print(line, file=sys.stderr, flush=True)), format_load_table, _bench_header(
        args, params, draft, f"{args.requests} requests a rate, {args.max_new_tokens} new tokens each, greedy; "
                             f"batch {args.max_batch}"))


def _bench_table(ap: _Parser, run, fmt, header: str) -> int:
    """Runs a benchmark (a ValueError or TypeError: one line, exit status 2) and prints its
    header and table."""
    try:
        rows = run()
    except (ValueError, TypeError) as err:
        ap.error(str(err))
    print(header)
    print(fmt(rows))
    return 0


def _bench(argv) -> int:
    from jspec.bench import format_table, run_bench

    if argv and argv[0] == "serve":
        return _bench_serve(argv[1:])
    ap = _bench_parser()
    args, params, draft, prompts = _bench_inputs(ap, argv, "bench")
    return _bench_table(ap, lambda: run_bench(params, prompts, batches=args.batch, specs=args.spec,
                                              max_new_tokens=args.max_new_tokens, repeats=args.repeats),
                        format_table, _bench_header(args, params, draft, f"{len(prompts)} prompts, "
                                                    f"{args.max_new_tokens} new tokens each, greedy; tokens/s: "
                                                    f"median of {args.repeats} timed passes"))


def serve_parser() -> _Parser:
    ap = _Parser(prog=f"{PROG} serve", description="Serves the model over an OpenAI-compatible HTTP API "
                                                   "(/v1/completions, /v1/chat/completions, /v1/models, /health, "
                                                   "/metrics) until SIGINT or SIGTERM. Every program it can run is "
                                                   "compiled before it listens.")
    _model_args(ap, "a draft directory or hub id, 'mtp', 'ngram' or 'none' (plain decoding); with the bundled "
                    "target 'eagle3' (the default), 'dflash' or 'standalone'")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    ap.add_argument("--port", type=_int(0, 65536), default=8000)
    ap.add_argument("--max-batch", type=_int(1), default=None,
                    help="requests decoded together (default: derived from the page pool, a row per 4096 of its "
                         "tokens, a power of two from 8 to 128; 8 on the CPU)")
    ap.add_argument("--max-len", type=_int(2), default=None,
                    help="prompt + generated tokens a request may hold (default: the model's context)")
    ap.add_argument("--max-new-tokens", type=_int(1), default=None,
                    help="a chat request's max_tokens when it gives none; a request may ask for up to --max-len less "
                         "its prompt (default: half of --max-len, at most 1024)")
    ap.add_argument("--spec", type=_spec_or_adaptive, default=None, metavar="S,K,N|adaptive",
                    help="draft steps, topk, verified tokens of every round (default: the draft's; a block "
                         "drafter's chain may add '/l:cost,...,S:cost', as `bench --spec`), or 'adaptive': "
                         "a tier chosen before each chunk of rounds from the measured acceptance and round costs")
    ap.add_argument("--rounds-per-chunk", type=_int(1), default=4, help="rounds between admissions (default: 4)")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"], default="auto",
                    help="what keys and values are stored in: auto (the model's dtype) or fp8 / fp8_e4m3 (E4M3, "
                         "half a bf16 cache's pages; GQA and MLA latent caches; divided by the checkpoint's "
                         "per-layer k_scale / v_scale where it has them)")
    ap.add_argument("--kv-cache-tokens", type=_int(1), default=None, metavar="N",
                    help="the page pool's size in tokens (pages of 16), shared by every request: a request is admitted "
                         "while its prompt and a little growth fit, and the latest is preempted (and later resumes) "
                         "when the rows outgrow it (default: what fits in --gpu-memory-utilization)")
    _compilation_cache_arg(ap)
    ap.add_argument("--enable-prefix-caching", "--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                    help="keep the full pages of prompts and outputs, so that a request beginning with a kept "
                         "prefix skips its prefill (default: on, where the model's cache allows it; "
                         "--no-prefix-cache is the same as --no-enable-prefix-caching)")
    ap.add_argument("--gpu-memory-utilization", type=_float(lambda v: 0 < v <= 1, "a number in (0, 1]"), default=0.9,
                    metavar="U", help="without --kv-cache-tokens, the pool takes the pages that fit in this share of "
                                      "the device's memory beside the weights, at most every row's whole --max-len "
                                      "(default: 0.9)")
    ap.add_argument("--prefill-chunk", type=_int(1), default=512,
                    help="prompt tokens a prefill pass takes; longer prompts are prefilled in blocks between "
                         "chunks of rounds (default: 512)")
    ap.add_argument("--max-num-batched-tokens", type=_int(1), default=16384, metavar="N",
                    help="prompt tokens one pass takes at most, over all its rows (a block of --prefill-chunk "
                         "each; default: 16384)")
    ap.add_argument("--constraint-states", type=_int(0), default=4096, metavar="N",
                    help="states of the structured-output tables (response_format, structured_outputs; 64 "
                         "exceptions a state; 0: no structured output; default: 4096)")
    ap.add_argument("--served-model-name", default=None, help="the name /v1/models lists and requests give "
                                                             "(default: the target's directory name or hub id, or "
                                                             "jspec-bundled)")
    ap.add_argument("--chat-template", default=None, metavar="FILE|STRING",
                    help="a Jinja chat template, or a file holding one, used instead of the tokenizer's")
    ap.add_argument("--api-key", default=os.environ.get("JSPEC_API_KEY"),
                    help="every /v1 route needs 'Authorization: Bearer KEY' (default: $JSPEC_API_KEY; none: open)")
    ap.add_argument("--request-timeout", type=_float(lambda v: v > 0, "a number of seconds > 0"), default=None,
                    metavar="SECONDS", help="a request that runs longer ends with finish_reason 'timeout' "
                                            "(default: no limit)")
    ap.add_argument("--max-logprobs", type=_int(0, 21), default=20,
                    help="the most alternatives a request's logprobs may list (0: no logprobs; default: 20)")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                    help="jspec's log (one access line a request, the reason of every refusal; default: info)")
    return ap


def _chat_template(ap: _Parser, value: str | None) -> str | None:
    """--chat-template: a file's text, or the string itself (a template has '{' in it)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        ap.error(f"argument --chat-template: no such file: {value!r} (and not a Jinja template)")
    return value


def _serve(argv) -> int:
    import logging
    import time

    ap = serve_parser()
    args = ap.parse_args(argv)
    try:
        import uvicorn
    except ImportError:
        ap.error("serving needs uvicorn, starlette, pydantic and prometheus_client: pip install 'jspec[serve]'")
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jspec").setLevel(args.log_level.upper())
    import jspec
    from jspec.serve.engine import static_heap
    from jspec.serve.server import build_app

    template = _chat_template(ap, args.chat_template)
    cache_dir = compilation_cache(args.compilation_cache)
    params, _ = _load(ap, args)
    context = getattr(params.config, "max_position_embeddings", None) or 4096
    max_len = args.max_len or context
    max_new = args.max_new_tokens or min(max_len // 2, 1024)
    if max_new >= max_len:
        ap.error(f"--max-new-tokens ({max_new}) must be below --max-len ({max_len})")
    page = jspec.CacheConfig.page_size
    cache = jspec.CacheConfig("paged", num_pages=-(-args.kv_cache_tokens // page) if args.kv_cache_tokens else None,
                              dtype=None if args.kv_cache_dtype == "auto" else "float8_e4m3fn")
    try:
        engine = jspec.Engine(params, max_batch=args.max_batch, max_prompt_len=max_len - 1, max_new_tokens=max_len - 1,
                              max_len=max_len, spec=args.spec, rounds_per_chunk=args.rounds_per_chunk,
                              prefill_chunk=args.prefill_chunk, max_logprobs=args.max_logprobs,
                              request_timeout=args.request_timeout, cache=cache,
                              memory_utilization=None if args.kv_cache_tokens else args.gpu_memory_utilization,
                              prefix_caching=args.enable_prefix_caching,
                              max_batched_tokens=args.max_num_batched_tokens,
                              constraint_states=args.constraint_states if params.tokenizer is not None else 0)
    except (ValueError, TypeError) as err:
        ap.error(str(err))
    pool = engine.pool_pages
    whole = engine.runner.pages_needed(max_len - max_new, max_new)
    from jspec.loop.plan import page_bytes
    gib = page_bytes(params, engine.plan) * pool / 2 ** 30
    sized = f"; {engine.runner.pool_note}" if engine.runner.pool_note else ""
    caching = "prefix caching on" if engine.runner.prefix_caching else "no prefix caching"
    slots = engine.runner.slots
    structured = ("no structured output" if slots is None else
                  f"structured output: tables of {slots.Q} states ({slots.nbytes / 2 ** 20:,.1f} MiB)")
    weight_bytes, fp8_bytes = params.weight_bytes()
    fp8 = f", {fp8_bytes / 2 ** 30:,.2f} GiB of them FP8" if fp8_bytes else ""
    print(f"{PROG} serve: weights {weight_bytes / 2 ** 30:,.2f} GiB{fp8}", flush=True)
    print(f"{PROG} serve: page pool of {pool} pages of {page} tokens ({pool * page} tokens, {gib:,.2f} GiB{sized}); "
          f"{pool // whole} requests of {max_len} tokens fit at once; batch {engine.batch}"
          f"{'' if args.max_batch else ' (derived from the pool)'}; {caching}; {structured}", flush=True)
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.target)) if args.target and
                                      os.path.isdir(args.target) else args.target) or "jspec-bundled"
    t0 = time.perf_counter()
    print(f"{PROG} serve: compiling every program the server can run ...", flush=True)
    engine.warm_up()
    blocks = (f"in blocks of {engine.runner.prefill_chunk} tokens" if engine.runner.prefill_chunk else
              f"whole, in one of {len(engine.runner.widths())} widths")
    kept = f"; kept in {cache_dir}" if cache_dir else ""
    print(f"{PROG} serve: {engine.stats.programs} programs compiled in {time.perf_counter() - t0:.1f} s "
          f"(prompt length makes none: prompts are passed {blocks}{kept})", flush=True)
    print(f"{PROG} serve: {name} on http://{args.host}:{args.port}/v1 (batch {engine.batch}, {max_len} tokens a "
          f"request, prompt and new; {max_new} new by default{', API key required' if args.api_key else ''})",
          flush=True)

    def stopped(signum, frame):  # uvicorn stops gracefully (the engine closed), then re-raises the signal here
        print(f"{PROG} serve: stopped ({signal.Signals(signum).name})", flush=True)
        raise SystemExit(0)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stopped)
    with static_heap():  # the start-up heap out of the garbage collector's full passes while serving
        uvicorn.run(build_app(engine, name, api_key=args.api_key, chat_template=template, default_max_tokens=max_new),
                    host=args.host, port=args.port, log_level="warning")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    if argv and argv[0] == "serve":
        return _serve(argv[1:])
    return _generate(argv)


if __name__ == "__main__":
    sys.exit(main())
