"""What a generation returns (`GenerateOutput`, `SpecStats`), read back from the loop's
rows on the host."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jspec.loop.state import FINISH_REASONS


@dataclasses.dataclass
class SpecStats:
    """Acceptance statistics. accept_lengths[i]: tokens committed per verify round of
    request i (accepted drafts + the bonus token; always 1 without a draft)."""

    accept_lengths: list[list[int]]
    mean_accept_length: float  # tau over every round of every request
    histogram: dict[int, int]  # accept length -> rounds
    rounds: list[int]
    tokens_per_s: float

    @property
    def tau(self) -> float:
        return self.mean_accept_length


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A token and the target's log-probability of it at its position (the log-softmax of
    the raw logits), with the `len(top)` most likely tokens there and theirs, most likely
    first (ties in index order)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass
class GenerateOutput:
    """tokens: generated ids only (a list for one prompt, a list of lists for a batch; an
    emitted stop token is included). finish_reasons: 'stop', 'length' or 'cache_full'.
    logprobs: a `TokenLogprob` per generated token of each request that asked for them
    (`logprobs=k`, k alternatives), else None; prompt_logprobs: the same for the prompt's
    tokens (`prompt_logprobs=k`), the first None (nothing precedes it)."""

    tokens: Any
    text: Any
    finish_reasons: Any
    stats: SpecStats
    timing: dict
    logprobs: Any = None
    prompt_logprobs: Any = None


def token_logprobs(res: dict, row: int, start: int, count: int, k: int) -> list[TokenLogprob]:
    """`TokenLogprob`s of buffer positions start .. start+count-1 of a row of a readback
    (host arrays with lp_* columns, as `jspec.loop.state.readback`)."""
    out = []
    for p in range(start, start + count):
        top = tuple((int(i), float(v)) for i, v in zip(res["lp_top_ids"][row, p, :k], res["lp_top"][row, p, :k]))
        out.append(TokenLogprob(int(res["tokens"][row, p]), float(res["lp_chosen"][row, p]), top))
    return out


def generate_output(params, plan, res: dict, reqs, *, compile_s: float, run_s: float) -> GenerateOutput:
    """The output of requests `reqs` (`jspec.requests.Requests`) in rows 0..n-1 of a state
    read back as `res` (`jspec.loop.state.readback`, host arrays)."""
    tokens, reasons, accept, lps, prompt_lps = [], [], [], [], []
    for i, l in enumerate(reqs.lens):
        g = int(res["generated"][i])
        tokens.append([int(t) for t in res["tokens"][i, l: l + g]])
        k, kp = reqs.logprobs[i], reqs.prompt_logprobs[i]
        lps.append(None if k is None else token_logprobs(res, i, l, g, k))
        prompt_lps.append(None if kp is None else [None] + token_logprobs(res, i, 1, l - 1, kp))
        reasons.append(FINISH_REASONS[int(res["reason"][i])])
        rounds = int(res["rounds"][i])
        accept.append([int(a) for a in res["hist"][i, :rounds]] if plan.proposer is not None else [1] * rounds)
    total = sum(len(t) for t in tokens)
    all_rounds = [a for row in accept for a in row]
    hist: dict[int, int] = {}
    for a in all_rounds:
        hist[a] = hist.get(a, 0) + 1
    tps = total / run_s if run_s > 0 else float("nan")
    stats = SpecStats(accept_lengths=accept,
                      mean_accept_length=float(np.mean(all_rounds)) if all_rounds else float("nan"),
                      histogram=dict(sorted(hist.items())), rounds=[len(a) for a in accept], tokens_per_s=tps)
    tok = params.tokenizer
    texts = [tok.decode(t, skip_special_tokens=True) for t in tokens] if tok is not None else None
    timing = dict(compile_s=compile_s, run_s=run_s, new_tokens=total, tokens_per_s=tps)
    if not reqs.is_batch:
        return GenerateOutput(tokens[0], texts[0] if texts else None, reasons[0], stats, timing, lps[0],
                              prompt_lps[0])
    return GenerateOutput(tokens, texts, reasons, stats, timing, lps if reqs.wants_logprobs else None,
                          prompt_lps if reqs.wants_prompt_logprobs else None)
