"""Adaptive speculation: a serving engine's choice, between chunks, of how much to draft.

Under load speculation can cost more than it saves: a round verifies N nodes per row, and
once the batch's products are compute-bound those nodes cost nearly what N decode steps
cost. The engine therefore keeps a few *tiers* (`Adaptive.tiers`: SpecConfigs, and None
for a plain tier), all sharing one loop state (`jspec.loop.plan.Plan.tiers`), and before
each chunk picks the tier with the most tokens a second for the rows that run:

    tokens/s of tier t  ~  E[accepted length of t] / cost of a round of t at this occupancy

- The cost of a round, per tier and per occupancy bucket (1, 2, 4, ... rows running), is
  measured when the engine starts (`measure_costs`, at `Adaptive.context` tokens of
  context), or given (`Adaptive.costs`), and then measured online: each chunk that ran
  with the device busy from its start (no admission or prefill queued before it) gives
  its seconds a round at its tier and occupancy (`observe_cost`), averaged with decay.
- The accepted length comes from what the device reports with each chunk (the accept
  length of every round of every row that speculates). A tier's own mean accepted length
  is used once it has run enough rounds (`Adaptive.min_rounds`, decayed); before that a
  model predicts it. Chains of a neural or n-gram proposer draft the same tokens whatever
  their depth (a chain of S drafts is the first S of a longer one), so the acceptance
  rate of the draft at each depth d, alpha_d (censored at each round's depth), predicts
  every chain: E = 1 + sum_{d<=S} alpha_1 ... alpha_d (depths never observed take the
  deepest observed rate); a tree's, 1 - (1 - alpha_d)^K a level. One pooled rate
  overestimated deep chains, whose later drafts are accepted less often than the first.
  Older rounds fade (`Adaptive.decay` a chunk).
- The plain tier drafts nothing, so while it runs the rate is not observed: every
  `probe_every` chunks one chunk runs the cheapest drafting chain to keep it fresh.
- A switch needs the best tier to beat the current one by `margin` (no flapping).

The plain tier still lets the proposer observe each round (a draft model's cache stays
current), which costs a draft forward a round; plain decoding without a draft is the
engine without one (`params.with_draft(None)`).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jspec.config import SpecConfig


def default_tiers(default: SpecConfig) -> tuple[SpecConfig | None, ...]:
    """Plain, chains of 1, 3 and 5 drafts, and a tree of 3 steps of 2 (6 nodes); a
    proposer's own default joins them if it is not among them."""
    tiers = [None, SpecConfig(1), SpecConfig(3), SpecConfig(5), SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)]
    if default not in tiers:
        tiers.append(default)
    return tuple(tiers)


@dataclasses.dataclass(frozen=True)
class Adaptive:
    """Adaptive speculation for `jspec.Engine(spec=jspec.Adaptive())` (see the module).

    tiers: SpecConfigs (None: a plain tier); None: `default_tiers`. costs: seconds a round
    per (tier index, occupancy bucket) to use instead of measuring them at start-up (the
    buckets are 1, 2, 4, ... up to the engine's batch). margin: how much better (a
    fraction) the best tier must look before the engine switches. decay: the weight a
    chunk's acceptance keeps per later chunk. probe_every: chunks on the plain tier
    between probes of the cheapest chain. alpha0: the acceptance rate assumed before any
    round was observed. min_rounds: decayed rounds after which a tier's own mean accepted
    length replaces the model's. context: prompt tokens of the placeholder requests that
    measure the costs at start-up. cost_decay: the weight a cost keeps per online
    measurement of its tier and bucket."""

    tiers: tuple | None = None
    costs: dict | None = None
    margin: float = 0.03
    decay: float = 0.8
    probe_every: int = 32
    alpha0: float = 0.6
    min_rounds: float = 16.0
    context: int = 256
    cost_decay: float = 0.9

    def __post_init__(self):
        if self.tiers is not None:
            if not self.tiers or not all(t is None or isinstance(t, SpecConfig) for t in self.tiers):
                raise ValueError("Adaptive.tiers must be a non-empty sequence of SpecConfigs and None (a plain tier)")
            if len(set(self.tiers)) != len(self.tiers):
                raise ValueError("Adaptive.tiers lists a tier twice")
            object.__setattr__(self, "tiers", tuple(self.tiers))
        for name, lo, hi in (("margin", 0.0, 1.0), ("decay", 0.0, 1.0), ("alpha0", 0.0, 0.999),
                             ("min_rounds", 0.0, float("inf")), ("cost_decay", 0.0, 1.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                raise ValueError(f"Adaptive.{name} must be a number in [{lo}, {hi}], got {v!r}")
        for name in ("probe_every", "context"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Adaptive.{name} must be an int >= 1, got {v!r}")


def buckets(batch: int) -> list[int]:
    """Occupancy buckets: 1, 2, 4, ... and the batch itself."""
    return sorted({min(1 << k, batch) for k in range(batch.bit_length() + 1)})


def bucket_of(n: int, batch: int) -> int:
    return min(1 << max(n - 1, 0).bit_length(), batch)


def tier_name(tier: SpecConfig | None) -> str:
    return "plain" if tier is None else f"{tier.num_steps},{tier.topk},{tier.num_draft_tokens}"


class Chooser:
    """The tier choice between chunks (see the module): acceptance per draft depth and per
    tier from the rounds each chunk ran, costs per tier and bucket (measured at start-up,
    then online), and the tier to run next."""

    def __init__(self, config: Adaptive, tiers: Sequence[SpecConfig | None], costs: dict, batch: int):
        self.config, self.tiers, self.costs, self.batch = config, list(tiers), dict(costs), batch
        depth = max((t.num_steps for t in self.tiers if t is not None), default=0)
        self.accepted = np.zeros(depth)  # drafts accepted at depth d + 1 (decayed)
        self.tried = np.zeros(depth)  # rounds whose chain tested depth d + 1 (decayed)
        self.tier_len = {i: (0.0, 0.0) for i, t in enumerate(self.tiers) if t is not None}  # (sum, rounds)
        self.since_observed = 0  # chunks since a chain's acceptance was last observed
        self.chosen: dict[str, int] = {tier_name(t): 0 for t in self.tiers}

    def alphas(self, depth: int) -> np.ndarray:
        """The acceptance rate of the draft at depths 1..depth: observed where rounds tested
        it, else the deepest observed depth's, else alpha0."""
        out, last = [], self.config.alpha0
        for d in range(depth):
            if d < len(self.tried) and self.tried[d] > 0:
                last = self.accepted[d] / self.tried[d]
            out.append(min(last, 0.999))
        return np.asarray(out)

    @property
    def alpha(self) -> float:
        """The first draft's acceptance rate."""
        return float(self.alphas(1)[0])

    def observe(self, tier: int, accept_lens: np.ndarray) -> None:
        """The accept lengths (root included, >= 1) of the rounds a chunk ran on `tier`."""
        d = self.config.decay
        spec = self.tiers[tier]
        self.accepted, self.tried = self.accepted * d, self.tried * d
        self.tier_len = {i: (s * d, n * d) for i, (s, n) in self.tier_len.items()}
        if spec is None or not len(accept_lens):
            self.since_observed += 1
            return
        lens = np.asarray(accept_lens)
        s, n = self.tier_len[tier]
        self.tier_len[tier] = (s + float(np.sum(lens)), n + len(lens))
        if spec.topk > 1:
            self.since_observed += 1
            return
        drafts = lens - 1  # accepted drafts, <= S
        depths = np.arange(1, spec.num_steps + 1)
        self.accepted[:spec.num_steps] += np.sum(drafts[:, None] >= depths[None, :], axis=0)
        self.tried[:spec.num_steps] += np.sum(drafts[:, None] >= depths[None, :] - 1, axis=0)
        self.since_observed = 0

    def expected_len(self, tier: int) -> float:
        """Expected tokens a round commits per row on `tier`."""
        spec = self.tiers[tier]
        if spec is None:
            return 1.0
        s, n = self.tier_len[tier]
        if n >= self.config.min_rounds:
            return s / n
        S = spec.num_steps if spec.topk == 1 else min(spec.num_steps, spec.num_draft_tokens - 1)
        a = self.alphas(S)
        if spec.topk > 1:
            a = 1.0 - (1.0 - a) ** spec.topk
        return 1.0 + float(np.sum(np.cumprod(a)))

    def observe_cost(self, tier: int, running: int, seconds: float) -> None:
        """A chunk's measured seconds a round on `tier` with `running` rows."""
        key = (tier, bucket_of(running, self.batch))
        d = self.config.cost_decay
        self.costs[key] = d * self.costs[key] + (1 - d) * seconds if key in self.costs else seconds

    def rate(self, tier: int, running: int) -> float:
        """Predicted tokens a second per running row."""
        return self.expected_len(tier) / self.costs[tier, bucket_of(running, self.batch)]

    def choose(self, current: int, running: int) -> int:
        """The tier for the next chunk with `running` rows running."""
        if running == 0:
            return current
        if self.tiers[current] is None and self.since_observed >= self.config.probe_every:
            chains = [i for i, t in enumerate(self.tiers) if t is not None and t.topk == 1]
            if chains:  # probe: the cheapest chain, for one chunk
                probe = min(chains, key=lambda i: self.costs[i, bucket_of(running, self.batch)])
                self.since_observed = 0
                self.chosen[tier_name(self.tiers[probe])] += 1
                return probe
        rates = [self.rate(i, running) for i in range(len(self.tiers))]
        best = int(np.argmax(rates))
        pick = best if rates[best] > rates[current] * (1.0 + self.config.margin) else current
        self.chosen[tier_name(self.tiers[pick])] += 1
        return pick


def measure_costs(runner, context: int, repeats: int = 2) -> dict:
    """Seconds a round per (tier index, occupancy bucket), measured on a runner's own
    programs before the engine serves (`jspec.serve.runner.Runner.time_rounds`): for each
    tier and bucket n, n placeholder requests with `context` prompt tokens are admitted,
    run a warm-up chunk and `repeats` timed chunks, then evicted."""
    return {(tier, n): runner.time_rounds(tier, n, context, repeats)
            for tier in range(len(runner.tiers)) for n in buckets(runner.batch)}
