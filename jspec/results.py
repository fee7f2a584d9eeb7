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


@dataclasses.dataclass
class GenerateOutput:
    """tokens: generated ids only (a list for one prompt, a list of lists for a batch; an
    emitted stop token is included). finish_reasons: 'stop', 'length' or 'cache_full'."""

    tokens: Any
    text: Any
    finish_reasons: Any
    stats: SpecStats
    timing: dict


def generate_output(params, plan, res: dict, lens: list[int], is_batch: bool, *, compile_s: float,
                    run_s: float) -> GenerateOutput:
    """The output of requests in rows 0..len(lens)-1 of a state read back as `res`
    (`jspec.loop.state.readback`, host arrays); lens: their prompt lengths."""
    tokens, reasons, accept = [], [], []
    for i, l in enumerate(lens):
        g = int(res["generated"][i])
        tokens.append([int(t) for t in res["tokens"][i, l: l + g]])
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
    if not is_batch:
        return GenerateOutput(tokens[0], texts[0] if texts else None, reasons[0], stats, timing)
    return GenerateOutput(tokens, texts, reasons, stats, timing)
