"""Adaptive speculation: a serving engine's choice, between chunks, of how much to draft.

Under load speculation can cost more than it saves: a round verifies N nodes per row, and
once the batch's products are compute-bound those nodes cost nearly what N decode steps
cost. The engine therefore keeps a few *tiers* (`Adaptive.tiers`: SpecConfigs, and None
for a plain tier), all sharing one loop state (`jspec.loop.plan.Plan.tiers`), and before
each chunk picks a tier from the expected accepted length E_r of each running row r on
each tier and the cost c of a round of the tier at this occupancy:

    rows free:        the least mean time a token of the rows,    c x sum_r 1 / E_r
    every row taken:  the least time a token of the requests,     c x sum_r E_r,now / E_r
                      (E_r,now: row r's on the tier that ran last)

- The cost of a round, per tier and per occupancy bucket (1, 2, 4, ... rows running), is
  measured when the engine starts (`measure_costs`, at `Adaptive.context` tokens of
  context; the median of three turns over every bucket and tier), or given
  (`Adaptive.costs`), and then measured online: each chunk that ran
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
  A tree's rounds inform alpha_d through that relation inverted (`chain_equivalent`):
  without them, a tree that ran kept the chains' rates at the pool's guess, which
  favoured the tree again (the 8B permutation target ran its tree for 69% of the chunks
  at 256 req/s, where the chain of the same depth, which accepts as much there, costs
  less; H200, 2026-11-28).
  Older rounds fade (`Adaptive.decay` a chunk).
- The plain tier drafts nothing, so while it runs the rates are not observed: every
  `probe_every` chunks one chunk runs the cheapest drafting chain to keep them fresh.
- The acceptance is also kept per running request (the same counts from its own rounds,
  faded with each drafting chunk it runs; plain rounds leave them as they are): rows
  differ (a request that repeats itself against one that never does), and the batch's
  tokens a round are theirs, not the pool's, whose rounds lean on rows that ran long or
  already left. A row's expected length starts at the pooled estimate and moves to its
  own as its rounds come in (`ROW_PRIOR`: the pool weighs as much as one of its rounds):
  its own mean on the tier, and the model at its own rates for the tiers it did not run.
- The objective: with rows free, finishing a row sooner frees one nobody needs, so the
  running requests' own speed counts, the least mean time a token. With every row taken
  and requests waiting, the time to serve them all does: a tier run throughout serves
  requests of T tokens in c x sum_req T / E_req row-seconds over the batch's rows, so the
  least time a token, over the *requests* rather than the rows. The batch over-represents
  the slow ones: a request stays T / E_r,now rounds on the tier that runs, so each row
  stands for E_r,now / T requests, and the weights E_r,now turn the batch back into the
  requests. (The batch's tokens a second, sum_r E_r / c, used here before, ran 5,1,6 for
  58% of the chunks of the 8B permutation target at 256 req/s, where half the requests
  accept every draft and half none: it counts the accepting rows' tokens, not the rounds
  the rejecting rows still hold their rows for. By the requests' time, 3,1,4 at the
  measured costs, the fastest fixed tier there; H200, 2026-11-28.) With rows alike every
  objective picks the same tier.
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

ROW_PRIOR = 1.0  # rounds: the pooled estimate weighs as much as this many of a running row's own rounds


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
        self.since_observed = 0  # chunks since drafts' acceptance was last observed
        self.chosen: dict[str, int] = {tier_name(t): 0 for t in self.tiers}
        self.row_keys: list = []  # the running requests last read (`read_rows`)
        self.row_stats = np.zeros((0, 2 * depth + 2 * len(self.tiers)))  # their own acceptance, a row each
        self.row_off = np.zeros((0,), bool)  # those with speculation off

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
        accepted, tried = depth_counts(spec, lens)
        self.accepted[:len(tried)] += accepted
        self.tried[:len(tried)] += tried
        self.since_observed = 0

    def pooled_lens(self, model: np.ndarray | None = None) -> np.ndarray:
        """Expected tokens a round commits per row on each tier (the pooled estimate): a
        tier's own mean once it ran `min_rounds` rounds, else the model at the pooled
        rates (model: those values, where already computed)."""
        if model is None:
            a = self.alphas(len(self.accepted))[None]
            model = np.array([model_len(t, a)[0] for t in self.tiers])
        own = [self.tier_len.get(i, (0.0, 0.0)) for i in range(len(self.tiers))]
        return np.array([s / n if n >= self.config.min_rounds else m for (s, n), m in zip(own, model)])

    def expected_len(self, tier: int) -> float:
        """Expected tokens a round commits per row on `tier` (the pooled estimate)."""
        return float(self.pooled_lens()[tier])

    def read_rows(self, running: Sequence) -> None:
        """The running requests' accept lengths since the last call (each request's
        `accepts`, the scheduler's: (tier, lengths) a chunk, emptied here) into their own
        records, a row of `row_stats` each (in the order of `running`, now `row_keys`):
        drafts accepted and tried at each depth (chain rounds), and per tier the sum of the
        lengths and the rounds; older chunks fade with each drafting chunk the row runs
        (plain rounds say nothing of the drafts). Requests no longer running are dropped;
        those with speculation off (`speculative` False) accept no draft."""
        D, T = len(self.accepted), len(self.tiers)
        where = {q: i for i, q in enumerate(self.row_keys)}
        stats = np.vstack([self.row_stats, np.zeros((1, 2 * D + 2 * T))])[[where.get(q, -1) for q in running]]
        chunks: dict = {}  # (k, tier) -> [(row, lengths)]: each row's k-th chunk since the last call
        for i, q in enumerate(running):
            for k, (tier, lens) in enumerate(q.accepts):
                if self.tiers[tier] is not None and len(lens):
                    chunks.setdefault((k, tier), []).append((i, np.asarray(lens)))
            q.accepts.clear()
        for (_, tier), items in sorted(chunks.items(), key=lambda kv: kv[0]):
            rows = np.array([i for i, _ in items])
            lens = np.concatenate([lens for _, lens in items])
            starts = np.cumsum([0] + [len(x) for _, x in items[:-1]])
            stats[rows] *= self.config.decay
            stats[rows, 2 * D + tier] += np.add.reduceat(lens, starts)
            stats[rows, 2 * D + T + tier] += [len(x) for _, x in items]
            S = levels(self.tiers[tier])
            depths = np.arange(1, S + 1)
            accepted = np.add.reduceat((lens[:, None] - 1 >= depths).astype(float), starts)  # [rows, S]
            tried = np.add.reduceat((lens[:, None] - 1 >= depths - 1).astype(float), starts)
            stats[rows, :S] += chain_equivalent(self.tiers[tier], accepted, tried)
            stats[rows, D:D + S] += tried
        self.row_keys, self.row_stats = list(running), stats
        self.row_off = np.array([not q.speculative for q in running], bool)

    def row_lens(self) -> np.ndarray:
        """Expected tokens a round commits, [rows, tiers], for the rows last read
        (`read_rows`): each row's own mean on the tier and the draft model at its own
        acceptance rates, shrunk toward the pooled estimate by `ROW_PRIOR` rounds (a row
        with no rounds of its own has the pooled estimate)."""
        D, T = len(self.accepted), len(self.tiers)
        stats, w = self.row_stats, ROW_PRIOR
        pool = self.alphas(D)
        a = np.vstack([np.minimum((stats[:, :D] + w * pool) / (stats[:, D:2 * D] + w), 0.999), pool])
        model = np.stack([model_len(t, a) for t in self.tiers], axis=1)  # [rows + 1, tiers]: the last at the pool's
        prior = model[:-1] * (self.pooled_lens(model[-1]) / model[-1])  # the model, scaled to the pooled estimate
        lens = (stats[:, 2 * D:2 * D + T] + w * prior) / (stats[:, 2 * D + T:] + w)
        lens[self.row_off] = 1.0
        return lens

    def observe_cost(self, tier: int, running: int, seconds: float) -> None:
        """A chunk's measured seconds a round on `tier` with `running` rows."""
        key = (tier, bucket_of(running, self.batch))
        d = self.config.cost_decay
        self.costs[key] = d * self.costs[key] + (1 - d) * seconds if key in self.costs else seconds

    def rates(self, lens: np.ndarray, current: int) -> np.ndarray:
        """Each tier's score for the next chunk (see the module), higher is better: the
        tokens a second of a row, from the running rows' expected lengths [rows, tiers]:
        their number over their summed seconds a token, each row weighted by its length on
        the `current` tier when every row is taken (the requests it stands for)."""
        n = len(lens)
        cost = np.array([self.costs[t, bucket_of(n, self.batch)] for t in range(len(self.tiers))])
        weight = lens[:, current:current + 1] if n >= self.batch else np.ones((n, 1))
        return weight.sum() / (cost * (weight / lens).sum(axis=0))

    def choose(self, current: int, running) -> int:
        """The tier for the next chunk. running: the running requests (the scheduler's, with
        their `accepts`), or how many rows run (each then has the pooled estimate)."""
        if isinstance(running, int):
            lens = np.tile(self.pooled_lens(), (running, 1))
        else:
            self.read_rows(running)
            lens = self.row_lens()
        n = len(lens)
        if n == 0:
            return current
        if self.tiers[current] is None and self.since_observed >= self.config.probe_every:
            chains = [i for i, t in enumerate(self.tiers) if t is not None and t.topk == 1]
            if chains:  # probe: the cheapest chain, for one chunk
                probe = min(chains, key=lambda i: self.costs[i, bucket_of(n, self.batch)])
                self.since_observed = 0
                self.chosen[tier_name(self.tiers[probe])] += 1
                return probe
        rates = self.rates(lens, current)
        best = int(np.argmax(rates))
        pick = best if rates[best] > rates[current] * (1.0 + self.config.margin) else current
        self.chosen[tier_name(self.tiers[pick])] += 1
        return pick


def levels(spec: SpecConfig) -> int:
    """The depths a round of a drafting tier can accept: a chain's drafts, a tree's levels."""
    return spec.num_steps if spec.topk == 1 else min(spec.num_steps, spec.num_draft_tokens - 1)


def chain_equivalent(spec: SpecConfig, accepted: np.ndarray, tried: np.ndarray) -> np.ndarray:
    """Drafts accepted at each depth as one chain's draft would have been, from a tier's
    counts (accepted, tried [..., depth]): a chain's own; a tree of K candidates a level
    accepts a level with 1 - (1 - alpha)^K (`model_len`), so its rate b over the tried
    counts gives alpha = 1 - (1 - b)^(1/K). A tree's rounds then inform the chains' rates
    as the model would predict them back: rows that accept every level of a tree accept
    every draft of a chain, and the cheaper chain of the same depth wins."""
    if spec.topk == 1:
        return accepted
    b = np.divide(accepted, tried, out=np.zeros(np.shape(accepted)), where=np.asarray(tried) > 0)
    return tried * (1.0 - (1.0 - np.minimum(b, 1.0)) ** (1.0 / spec.topk))


def depth_counts(spec: SpecConfig, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A drafting tier's rounds (accept lengths, root included) -> drafts accepted (as a
    chain's, `chain_equivalent`) and drafts tried at depths 1..levels (a round tries depth d
    when it accepted the d - 1 before it)."""
    drafts = np.asarray(lens)[:, None] - 1  # accepted drafts, <= levels
    depths = np.arange(1, levels(spec) + 1)[None, :]
    tried = np.sum(drafts >= depths - 1, axis=0)
    return chain_equivalent(spec, np.sum(drafts >= depths, axis=0), tried), tried


def model_len(spec: SpecConfig | None, alphas: np.ndarray) -> np.ndarray:
    """Expected tokens a round commits on tier `spec` at draft acceptance rates alphas
    [rows, depth] (see the module) -> [rows]."""
    if spec is None:
        return np.ones(len(alphas))
    S = levels(spec)
    a = alphas[:, :S]
    if spec.topk > 1:
        a = 1.0 - (1.0 - a) ** spec.topk
    return 1.0 + np.sum(np.cumprod(a, axis=1), axis=1)


def measure_costs(runner, context: int, repeats: int = 2, samples: int = 3) -> dict:
    """Seconds a round per (tier index, occupancy bucket), measured on a runner's own
    programs before the engine serves (`jspec.serve.runner.Runner.time_rounds`): for each
    tier and bucket n, n placeholder requests with `context` prompt tokens are admitted,
    run a warm-up chunk and `repeats` timed chunks, then evicted; the median of `samples`
    such measurements, taken in turns (each sample every bucket, each bucket every tier),
    so that a pause or a drift of the device's speed does not fall on one tier's costs.
    (One sample of two chunks, tier after tier, gave the 2-core CPU a plain round at 16
    rows 1.7 times its cost at 8 and 32, which the choice kept: the plain tier never ran
    there to measure it again.)"""
    times = {(tier, n): [] for tier in range(len(runner.tiers)) for n in buckets(runner.batch)}
    for _ in range(samples):
        for n in buckets(runner.batch):
            for tier in range(len(runner.tiers)):
                times[tier, n].append(runner.time_rounds(tier, n, context, repeats))
    return {key: float(np.median(t)) for key, t in times.items()}
