"""The adaptive speculation choice (`jspec.serve.tiers`), on synthetic rounds (no model).

- The per-draft acceptance rate is estimated without bias from rounds censored at each
  chain's depth (a naive estimator that ignores the censoring is visibly off on the same
  rounds), and predicts a chain's expected accepted length.
- The choice picks plain rounds when drafts are rarely accepted and deep chains when
  they mostly are, stays put inside the margin, probes a chain while on the plain tier,
  and uses a tree's own accepted lengths once it has run.
- The choice follows the rows that run, each with its own acceptance: rows that never
  accept a draft run plain rounds whatever the pool saw of rows gone; with every row
  taken the requests' time a token counts (the rows weighted back to the requests they
  stand for), with rows free each request's own speed (a deep chain that speeds up the
  accepting rows but slows the others is left).
- The start-up costs are medians of measurements taken in turns: a pause during one of
  them sets no cost.
- Bad settings are refused with the setting's name.
"""
from __future__ import annotations

import numpy as np
import pytest

from jspec.config import SpecConfig
from jspec.serve.tiers import Adaptive, Chooser, bucket_of, buckets, default_tiers, measure_costs

TIERS = [None, SpecConfig(1), SpecConfig(3), SpecConfig(5), SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)]
# Seconds a round at every bucket: drafting costs more the deeper it goes.
COSTS = {(t, n): c for t, c in enumerate([1.0, 1.15, 1.35, 1.6, 1.5]) for n in buckets(8)}


def chain_rounds(rng, alpha: float, S: int, n: int) -> np.ndarray:
    """Accept lengths (root included) of n chain rounds of S drafts, each draft accepted
    with probability alpha until the first rejection."""
    drafts = np.minimum(rng.geometric(1.0 - alpha, size=n) - 1, S)
    return drafts + 1


def test_acceptance_rate_from_censored_rounds():
    rng = np.random.default_rng(0)
    for alpha, tier in ((0.7, 2), (0.4, 1), (0.85, 3)):
        c = Chooser(Adaptive(decay=1.0), TIERS, COSTS, 8)
        lens = chain_rounds(rng, alpha, TIERS[tier].num_steps, 20000)
        c.observe(tier, lens)
        assert abs(c.alpha - alpha) < 0.015, (alpha, c.alpha)
        S = TIERS[tier].num_steps
        assert abs(c.expected_len(tier) - lens.mean()) < 0.03
        if S > 1:  # ignoring the censoring (accepted drafts over drafts offered) is biased low
            naive = (lens - 1).sum() / (S * len(lens))
            assert alpha - naive > 0.05, (alpha, naive)
    # Deeper chains are predicted from the shallow one's rate.
    c = Chooser(Adaptive(decay=1.0), TIERS, COSTS, 8)
    c.observe(1, chain_rounds(rng, 0.8, 1, 20000))
    deep = chain_rounds(rng, 0.8, 5, 20000)
    assert abs(c.expected_len(3) - deep.mean()) < 0.06


def test_choice_follows_acceptance_and_cost():
    rng = np.random.default_rng(1)
    low = Chooser(Adaptive(decay=1.0), TIERS, COSTS, 8)
    low.observe(2, chain_rounds(rng, 0.1, 3, 5000))
    assert low.choose(2, running=8) == 0  # drafts rarely accepted: plain rounds
    high = Chooser(Adaptive(decay=1.0), TIERS, COSTS, 8)
    high.observe(2, chain_rounds(rng, 0.9, 3, 5000))
    assert high.choose(0, running=8) == 3  # mostly accepted: the deepest chain
    # Inside the margin the tier stays: make tier 1 barely better than tier 0.
    costs = dict(COSTS) | {(1, 8): (1.0 + 0.5) / 1.01}  # alpha 0.5: E = 1.5 tokens a round
    c = Chooser(Adaptive(decay=1.0, margin=0.03, alpha0=0.5), TIERS[:2], costs, 8)
    assert c.choose(0, running=8) == 0
    assert Chooser(Adaptive(decay=1.0, margin=0.0, alpha0=0.5), TIERS[:2], costs, 8).choose(0, running=8) == 1
    assert c.choose(0, running=0) == 0  # nothing running: nothing to choose


def test_probe_from_plain_and_tree_acceptance():
    rng = np.random.default_rng(2)
    c = Chooser(Adaptive(decay=1.0, probe_every=3), TIERS, COSTS, 8)
    c.observe(2, chain_rounds(rng, 0.05, 3, 2000))
    picks = []
    tier = c.choose(2, running=4)
    for _ in range(8):
        c.observe(tier, np.ones(4, np.int32) if TIERS[tier] is None else chain_rounds(rng, 0.05, 1, 4))
        tier = c.choose(tier, running=4)
        picks.append(tier)
    assert picks.count(1) == 2 and picks.count(0) == 6  # the cheapest chain every third chunk on plain
    # A tree's own accepted lengths replace the chain model's guess once it has run.
    t = Chooser(Adaptive(decay=1.0), TIERS, COSTS, 8)
    t.observe(2, chain_rounds(rng, 0.6, 3, 5000))
    guess = t.expected_len(4)
    t.observe(4, np.full(100, 3.5))
    assert t.expected_len(4) == pytest.approx(3.5) and guess != pytest.approx(3.5)


def tree_rounds(rng, alpha: float, levels: int, K: int, n: int) -> np.ndarray:
    """Accept lengths of n tree rounds whose every level holds K candidates, each the right
    token with probability alpha: a level is accepted with 1 - (1 - alpha)^K."""
    b = 1.0 - (1.0 - alpha) ** K
    return np.minimum(rng.geometric(1.0 - b, size=n) - 1, levels) + 1


def test_tree_rounds_inform_the_chains():
    rng = np.random.default_rng(4)
    # Tree rounds (K = 2) alone give each draft's rate through the tree's model inverted;
    # taking the tree's level rate for it (the wrong reference) is far off.
    c = Chooser(Adaptive(decay=1.0), TIERS, COSTS, 8)
    c.observe(4, tree_rounds(rng, 0.5, 3, 2, 20000))
    assert abs(c.alpha - 0.5) < 0.02 and abs(c.alpha - 0.75) > 0.2, c.alpha
    # Rows whose tree rounds accept every level accept every draft of a chain: the chain
    # of the same depth (cheaper, 1.35 against 1.5) beats the tree, and the deepest wins.
    rows = [Row((4, np.full(4, 4)), (4, np.full(4, 4))) for _ in range(8)]
    t = Chooser(Adaptive(), TIERS, COSTS, 8)
    t.read_rows(rows)
    E = t.row_lens()
    assert E[0, 2] > 3.5 and E[0, 2] > E[0, 4] - 0.3
    assert t.choose(4, rows) == 3


class Row:
    """A running request as the chooser reads it: its accept lengths, (tier, lengths) a
    chunk, and whether it speculates."""

    def __init__(self, *chunks, speculative=True):
        self.accepts, self.speculative = list(chunks), speculative


def test_choice_follows_the_running_rows():
    # Rows that accepted every draft ran and left; those running now never accept one.
    c = Chooser(Adaptive(), TIERS, COSTS, 8)
    gone, running = [Row() for _ in range(8)], [Row() for _ in range(4)]
    for _ in range(3):
        for q in gone:
            q.accepts.append((2, np.full(4, 4)))
        c.choose(2, gone)
        c.observe(2, np.full(32, 4))
    for _ in range(2):
        for q in running:
            q.accepts.append((2, np.ones(4, np.int32)))
        c.observe(2, np.ones(16, np.int32))
    assert c.choose(2, 4) == 3  # the pool still leans on the rows gone: the deepest chain
    assert c.choose(2, running) == 0  # the rows running never accept: plain rounds
    assert c.row_keys == running and len(c.row_stats) == 4  # the records of rows gone are dropped


def test_objective_with_every_row_taken_or_rows_free():
    # Half the rows accept every draft, half none; a chain of 3 costs twice a plain round.
    costs = {(t, n): c for t, c in enumerate([1.0, 1.9, 2.0, 2.6, 2.6]) for n in buckets(8)}

    def rows(n):
        return [Row((2, np.full(4, 4 if i % 2 else 1)), (2, np.full(4, 4 if i % 2 else 1))) for i in range(n)]
    full, part = Chooser(Adaptive(), TIERS, costs, 8), Chooser(Adaptive(), TIERS, costs, 8)
    # Every row taken, a batch formed on plain rounds (as many rows of each kind as
    # requests): the requests' time a token. Plain: 1 a token each; the chain: 2 / 4 and
    # 2 / 1, 2.5 over the pair. The batch's tokens a second (16 + 4 over 2 against 8 over
    # 1) would take the chain, which serves the requests 1.25x slower.
    assert full.choose(0, rows(8)) == 0
    # A batch formed on the chain over-represents the rejecting requests (they stay 4x the
    # rounds); weighted back, with a chain of 1.45 the chain serves them faster (1.45 x
    # 1.25 against 2 a pair), where the rows' mean time a token, unweighted, would not.
    cheap = dict(costs) | {(2, 8): 1.45}
    formed = [Row((2, np.full(4, 4)), (2, np.full(4, 4))) for _ in range(2)]
    formed += [Row((2, np.ones(4, np.int32)), (2, np.ones(4, np.int32))) for _ in range(6)]
    on_chain = Chooser(Adaptive(), TIERS, cheap, 8)
    assert on_chain.choose(2, formed) == 2
    on_chain.read_rows(formed)
    E = on_chain.row_lens()
    assert 1.45 * (1 / E[:, 2]).sum() > 1.0 * (1 / E[:, 0]).sum() * 1.03
    # Rows free: each request's own speed; the chain would slow the rejecting half by 2x.
    assert part.choose(0, rows(4)) == 0
    assert part.choose(2, rows(4)) == 0
    part.read_rows(rows(2))
    E = part.row_lens()
    assert E[0, 2] < 1.3 and E[1, 2] > 3.5 and E[0, 0] == E[1, 0] == 1.0
    # A request with speculation off accepts no draft, whatever the pool.
    off = Chooser(Adaptive(), TIERS, costs, 8)
    off.read_rows([Row(speculative=False), Row()])
    assert list(off.row_lens()[0]) == [1.0] * 5 and off.row_lens()[1, 2] > 1.5
    # The pooled estimate alone (an int) cannot tell: the same tier either way.
    pooled = Chooser(Adaptive(), TIERS, costs, 8)
    pooled.observe(2, np.array([4, 1] * 8))
    assert pooled.choose(0, 8) == pooled.choose(0, 4)


def test_start_up_costs_are_medians_taken_in_turns():
    class Runner:
        tiers, batch = TIERS[:3], 4

        def __init__(self):
            self.calls = []

        def time_rounds(self, tier, n, context, repeats):
            self.calls.append((tier, n))
            return 10.0 if len(self.calls) == 5 else 1.0 + tier + n / 100  # a pause in the fifth
    r = Runner()
    costs = measure_costs(r, context=16)
    assert costs == {(t, n): 1.0 + t + n / 100 for t in range(3) for n in buckets(4)}
    assert r.calls[:4] == [(0, 1), (1, 1), (2, 1), (0, 2)]  # every tier at a bucket, then the next bucket
    assert len(r.calls) == 3 * 3 * 3


def test_buckets_and_defaults():
    assert buckets(8) == [1, 2, 4, 8] and buckets(6) == [1, 2, 4, 6] and buckets(1) == [1]
    assert [bucket_of(n, 8) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert default_tiers(SpecConfig(3))[:4] == (None, SpecConfig(1), SpecConfig(3), SpecConfig(5))
    assert default_tiers(SpecConfig(4))[-1] == SpecConfig(4)


@pytest.mark.parametrize("kw,match", [(dict(tiers=()), "non-empty"), (dict(tiers=(None, None)), "twice"),
                                      (dict(tiers=(3,)), "SpecConfigs"), (dict(margin=-0.1), "Adaptive.margin"),
                                      (dict(decay=2.0), "Adaptive.decay"), (dict(probe_every=0), "probe_every")])
def test_bad_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        Adaptive(**kw)
