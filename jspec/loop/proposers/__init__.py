"""Proposers: the draft side of a round, behind one protocol (`base.Proposer`).

`neural.NeuralProposer` runs a draft model (`jspec.drafts`: EAGLE, EAGLE-3, standalone,
MTP) step by step; `block.BlockProposer` runs a block drafter (`jspec.drafts.dflash`), one
forward a round; `ngram.NgramDraft` looks the row's own tokens up. A new proposer is a file here
with a frozen class implementing the protocol; `jspec.loop.plan.proposer_for` maps a
loaded draft's config to its proposer.
"""
from jspec.loop.proposers.base import Observation, Proposer
from jspec.loop.proposers.block import BlockProposer
from jspec.loop.proposers.neural import NeuralProposer
from jspec.loop.proposers.ngram import NgramDraft

__all__ = ["BlockProposer", "NeuralProposer", "NgramDraft", "Observation", "Proposer"]
