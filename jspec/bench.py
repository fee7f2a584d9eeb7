"""Speculative decoding against plain decoding, on your model and prompts.

`run_bench` compiles one program per batch size and configuration (`jspec.compile`), runs
every prompt through it in groups of that batch size once to warm up, then makes `repeats`
timed passes that alternate between the configurations, and returns one `BenchRow` per
batch and configuration: tau (mean accepted length per round), tokens/s (median over the
timed passes) and the speed-up over plain decoding at the same batch. `format_table` renders the rows; `python -m jspec bench` is the CLI.

Greedy, with no stop tokens: every request generates exactly `max_new_tokens`, so each
configuration does the same work and the outputs can be compared token for token.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
from typing import Sequence

from jspec.config import SpecConfig

# Chains and trees worth trying first: a short chain, a small tree, a wide tree.
DEFAULT_SPECS = (SpecConfig(num_steps=3, topk=1, num_draft_tokens=4),
                 SpecConfig(num_steps=5, topk=4, num_draft_tokens=8),
                 SpecConfig(num_steps=5, topk=8, num_draft_tokens=16))

# Used when no prompt file is given: beginnings of ordinary Python code.
BUILTIN_PROMPTS = (
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(argv=None):\n",
    "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n",
    "def read_config(path):\n    \"\"\"Read a key=value file into a dict.\"\"\"\n    result = {}\n",
)


@dataclasses.dataclass(frozen=True)
class BenchRow:
    """One batch size and configuration. spec None: plain decoding (tau 1)."""

    batch: int
    spec: SpecConfig | None
    tau: float  # mean accepted length per round, over every round of every request
    tokens_per_s: float  # median over the timed passes
    speedup: float  # tokens_per_s / plain decoding's at the same batch
    match: float  # share of prompts whose tokens equal plain decoding's
    compile_s: float
    runs_tokens_per_s: tuple[float, ...]  # every timed pass

    @property
    def name(self) -> str:
        if self.spec is None:
            return "plain"
        return "chain" if self.spec.is_chain else "tree"

    @property
    def shape(self) -> str:
        s = self.spec
        if s is None:
            return "-"
        counts, table = s.cost_table
        budget = "+".join(",".join(f"{n}:{c:g}" for n, c in zip(s.verify_choices, costs))
                          + (f"@{rows}" if s.verify_cost_rows else "") for rows, costs in zip(counts, table))
        if budget and s.survival_power != 1.0:
            budget += f"^{s.survival_power:g}"
        return f"{s.num_steps},{s.topk},{s.num_draft_tokens}" + (f"/{budget}" if budget else "")

    @property
    def round_ms(self) -> float:
        """A round's time (each of the batch's rows commits tau tokens a round): the relative
        cost of a chain length for `SpecConfig.verify_costs`."""
        return 1000.0 * self.tau * self.batch / self.tokens_per_s


def parse_spec(text: str) -> SpecConfig:
    """'S', 'S,K' or 'S,K,N' -> SpecConfig (N defaults as SpecConfig's does), optionally
    followed by '/l:cost,...,S:cost' for confidence-budgeted verification (each length a
    round may verify with its round's relative cost, the last S: `SpecConfig.verify_lengths`
    and `verify_costs`), or by several such groups joined by '+', each ending '@rows' (the
    running rows its costs were measured at: `verify_cost_rows`), and then '^P'
    (`survival_power`): e.g. '15/3:1.0,7:1.1,15:1.3^0.5' or
    '15/3:0.61,7:0.64,15:0.62@1+3:1.1,7:1.36,15:1.61@16'. ValueError if bad."""
    shape, _, budget = text.partition("/")
    spec = _parse_shape(shape)
    if not budget:
        return spec
    budget, _, power = budget.partition("^")
    bad = ValueError(f"expected '/length:cost,...[@rows][+...][^power]' after the shape, the last length S, "
                     f"got {text!r}")
    try:
        groups = []
        for group in budget.split("+"):
            pairs, at, rows = group.partition("@")
            groups.append(([(int(n), float(c)) for n, c in (p.split(":") for p in pairs.split(","))],
                           int(rows) if at else None))
        power = float(power) if power else 1.0
    except ValueError:
        raise bad from None
    lengths = [n for n, _ in groups[0][0]]
    if any([n for n, _ in pairs] != lengths for pairs, _ in groups) or \
            (len(groups) > 1 or groups[0][1] is not None) and any(rows is None for _, rows in groups):
        raise bad
    if lengths[-1] != spec.num_steps:
        raise ValueError(f"the last length of {text!r} must be S = {spec.num_steps} (the whole chain)")
    costs = [tuple(c for _, c in pairs) for pairs, _ in groups]
    rows = tuple(r for _, r in groups) if groups[0][1] is not None else ()
    return dataclasses.replace(spec, verify_lengths=tuple(lengths[:-1]), verify_costs=tuple(costs) if rows else costs[0],
                               verify_cost_rows=rows, survival_power=power)


def _parse_shape(text: str) -> SpecConfig:
    parts = [p.strip() for p in text.split(",")]
    if not 1 <= len(parts) <= 3:
        raise ValueError(f"expected S,K,N (steps, topk, draft tokens), got {text!r}")
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"expected integers S,K,N (steps, topk, draft tokens), got {text!r}") from None
    return SpecConfig(*nums)


def read_prompts(path: str) -> list[str]:
    """One prompt per line; blank lines skipped. A line that is a JSON string ("...") is
    decoded, so a prompt can hold newlines ("def f(x):\\n    return")."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    out = []
    for line in lines:
        if not line.strip():
            continue
        if line.startswith('"'):
            try:
                decoded = json.loads(line)
            except ValueError:
                decoded = None
            if isinstance(decoded, str):
                line = decoded
        out.append(line)
    if not out:
        raise ValueError(f"{path}: no prompts (one per line)")
    return out


def _groups(prompts: list, batch: int) -> list[list]:
    """Full groups of `batch` prompts: the list is repeated cyclically up to a multiple of
    `batch` (so batch 4 runs 4 requests even with fewer prompts)."""
    n = -(-len(prompts) // batch) * batch
    reqs = [prompts[i % len(prompts)] for i in range(n)]
    return [reqs[i: i + batch] for i in range(0, n, batch)]


def run_bench(params, prompts: Sequence | None = None, *, batches: Sequence[int] = (1,),
              specs: Sequence[SpecConfig] | None = None, max_new_tokens: int = 64, repeats: int = 3,
              cache=None, progress: bool | None = None) -> list[BenchRow]:
    """Times plain decoding and each speculative configuration in `specs` at each batch size.

    params: what `jspec.load` returns, with a draft (its target alone gives the plain rows).
    prompts: strings or token-id lists (None: `BUILTIN_PROMPTS`). At batch b they run in
    groups of b (repeated cyclically to fill the last group), each pass running every group once; a pass's tokens/s is its tokens over
    the sum of its runs' device time (`timing['run_s']`, compile excluded).
    progress: a tqdm bar on stderr (None: only on a terminal).
    Rows come per batch, plain decoding first, then `specs` in order.
    """
    import jspec
    from tqdm.auto import tqdm

    if params.draft is None:
        raise ValueError("run_bench needs params with a draft (jspec.load(target, draft=...))")
    prompts = list(BUILTIN_PROMPTS if prompts is None else prompts)
    if not prompts:
        raise ValueError("prompts is empty")
    specs = list(DEFAULT_SPECS if specs is None else specs)
    for s in specs:
        if not isinstance(s, SpecConfig):
            raise TypeError(f"specs must hold jspec.SpecConfig, got {type(s).__name__}")
    batches = list(batches)
    for b in batches:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"batch sizes must be ints >= 1, got {b!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    kw = dict(max_new_tokens=max_new_tokens, stop_token_ids=[], cache=cache)

    plain_params = params.with_draft(None)

    def prog_run(prog, group):
        return prog.run(group, max_new_tokens=max_new_tokens, stop_token_ids=[])

    configs = [None] + specs
    rows: list[BenchRow] = []
    bar = tqdm(total=len(batches) * len(configs) * (repeats + 2), desc="bench", unit="step",
               disable=None if progress is None else not progress, leave=False)
    try:
        for b in batches:
            groups = _groups(prompts, b)
            # Compile with the group holding the longest prompt, so every group fits the
            # program's prompt-length bucket.
            longest = max(groups, key=lambda g: max(_length(params, p) for p in g))
            progs, compile_s, outs, passes = [], [], [], []
            for spec in configs:
                label = f"batch {b}, " + ("plain" if spec is None else
                                          f"S,K,N={spec.num_steps},{spec.topk},{spec.num_draft_tokens}")
                bar.set_description(f"{label}: compile")
                progs.append(jspec.compile(plain_params if spec is None else params, longest, spec=spec, **kw))
                compile_s.append(progs[-1].compile_s)  # a run resets it
                bar.update()
                bar.set_description(f"{label}: warm-up")
                outs.append([prog_run(progs[-1], g) for g in groups])
                passes.append([])
                bar.update()
            # Timed passes alternate between the configurations, so a machine whose speed
            # drifts (a shared CPU) slows them all alike.
            for r in range(repeats):
                bar.set_description(f"batch {b}: timed pass {r + 1}/{repeats}")
                for i, prog in enumerate(progs):
                    outs[i] = [prog_run(prog, g) for g in groups]
                    tokens = sum(o.timing["new_tokens"] for o in outs[i])
                    seconds = sum(o.timing["run_s"] for o in outs[i])
                    passes[i].append(tokens / seconds if seconds > 0 else float("nan"))
                    bar.update()
            plain_tokens = [t for o in outs[0] for t in o.tokens]  # groups are batches: a list per request
            plain_tps = statistics.median(passes[0])
            for spec, secs, out, tps_runs in zip(configs, compile_s, outs, passes):
                toks = [t for o in out for t in o.tokens]
                rounds = [a for o in out for row in o.stats.accept_lengths for a in row]
                tps = statistics.median(tps_runs)
                rows.append(BenchRow(
                    batch=b, spec=spec, tau=sum(rounds) / len(rounds) if rounds else float("nan"),
                    tokens_per_s=tps, speedup=tps / plain_tps if plain_tps else float("nan"),
                    match=sum(x == y for x, y in zip(toks, plain_tokens)) / len(toks),
                    compile_s=secs, runs_tokens_per_s=tuple(tps_runs)))
    finally:
        bar.close()
    return rows


def _length(params, prompt) -> int:
    """A prompt's length in tokens (characters for a string the model cannot tokenize:
    compiling it then fails with jspec's own error)."""
    if isinstance(prompt, str) and params.tokenizer is not None:
        return len(params.tokenizer(prompt)["input_ids"])
    return len(prompt)


def format_table(rows: Sequence[BenchRow]) -> str:
    """A Markdown table, columns aligned: batch, decoding, S,K,N, tau, tokens/s, speed-up,
    ms a round, same output (share of prompts equal to plain decoding), compile s."""
    head = ["batch", "decoding", "S,K,N", "tau", "tokens/s", "speed-up", "ms/round", "same output", "compile s"]
    body = [[str(r.batch), r.name, r.shape, f"{r.tau:.2f}", f"{r.tokens_per_s:.0f}", f"{r.speedup:.2f}x",
             f"{r.round_ms:.2f}", f"{r.match:.0%}", f"{r.compile_s:.1f}"] for r in rows]
    widths = [max(len(c) for c in col) for col in zip(head, *body)]
    left = {1, 2}  # text columns; numbers right-aligned

    def line(cells):
        return "| " + " | ".join(c.ljust(w) if i in left else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    rule = "| " + " | ".join("-" * w if i in left else "-" * (w - 1) + ":" for i, w in enumerate(widths)) + " |"
    return "\n".join([line(head), rule] + [line(r) for r in body])
