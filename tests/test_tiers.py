"""The adaptive speculation choice (`jspec.serve.tiers`), on synthetic rounds (no model).

- The per-draft acceptance rate is estimated without bias from rounds censored at each
  chain's depth (a naive estimator that ignores the censoring is visibly off on the same
  rounds), and predicts a chain's expected accepted length.
- The choice picks plain rounds when drafts are rarely accepted and deep chains when
  they mostly are, stays put inside the margin, probes a chain while on the plain tier,
  and uses a tree's own accepted lengths once it has run.
- Bad settings are refused with the setting's name.
"""
from __future__ import annotations

import numpy as np
import pytest

from jspec.config import SpecConfig
from jspec.serve.tiers import Adaptive, Chooser, bucket_of, buckets, default_tiers

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
