"""The proposer protocol: the draft side of a round.

A proposer is a frozen, hashable object (part of the loop's `Plan`, a static jit argument)
that owns one pytree of state inside the loop state (`LoopState.proposal`; each proposer
documents its fields' shapes). The loop calls it twice a round and once per admission:

  propose(state, loop state, active) -> (state, Tree of N nodes per row, log q or None)
  observe(state, Observation)        -> state   (the committed tokens: a prompt after an
                                                admission's prefill, the accepted path
                                                after a round)

Its state must not depend on the SpecConfig: the tiers of a serving engine (`Plan.tiers`)
share one state, and a plain tier (spec None) observes without drafting. The loop asks
it, when the plan is made, which target layers it reads (`target_layers`), how
far past L a round writes its caches (`slack`) and whether a SpecConfig suits it
(`check_spec`). The loop never asks which proposer it runs. Two exist: `NeuralProposer`
(a draft model: EAGLE, EAGLE-3, standalone, MTP) and `NgramDraft` (prompt lookup in the
row's own tokens, no weights).
"""
from __future__ import annotations

from typing import Any

import jax
from flax import struct

from jspec.config import SpecConfig
from jspec.sampling import SamplingParams


@struct.dataclass
class Observation:
    """What a proposer reads once tokens are committed, for R rows (R = B after a round, A
    after an admission).

    Tokens t = 0..count-1 went into target slots start + t; `bonus` is the token after
    them (the new root, at slot L, not yet in the target cache)."""

    rows: jax.Array | None  # [R] the request rows (None: all B, in order)
    start: jax.Array  # [R] first committed slot (0 for a prompt; the old L after a round)
    tokens: jax.Array  # [R, T'] the committed tokens (the prompt; the path from the old root)
    count: jax.Array  # [R] valid entries of tokens
    bonus: jax.Array  # [R] the new root
    L: jax.Array  # [R] slots committed now (start + count)
    hidden: jax.Array  # [R, T'', D] the target's final-norm hidden at the pass's tokens or nodes
    aux: dict  # {layer: [R, T'', D]} the target layer inputs captured (`target_layers`)
    path: jax.Array | None  # [R, S+1] node of each committed token in hidden (a tree); None: t itself
    live: jax.Array  # [R] rows that go on (the rest finished: their state may be anything)
    sampling: SamplingParams  # [R] the rows' sampling values
    pages: Any  # the page table every cache shares (PageState; None when dense)
    prefill: bool = struct.field(pytree_node=False, default=False)  # a prompt (the pass was a prefill)


class Proposer:
    """Base class of proposers (subclasses are frozen dataclasses)."""

    def target_layers(self) -> tuple[int, ...]:
        """Target layers whose inputs `observe` reads (captured in the target's forward)."""
        return ()

    def default_spec(self) -> SpecConfig:
        """The SpecConfig used when a call gives none."""
        return SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)

    def check_spec(self, spec: SpecConfig) -> None:
        """Raises ValueError naming the setting when `spec` does not suit this proposer."""

    def estimates_acceptance(self) -> bool:
        """Whether its chains carry each node's estimated chance of acceptance
        (`Tree.survival`), which confidence-budgeted verification
        (`SpecConfig.verify_lengths`, `jspec.loop.budget`) reads."""
        return False

    def slack(self, spec: SpecConfig, paged: bool) -> int:
        """Slots past L that this proposer's own caches may be written in one round (its
        forwards and the room their cache kind asks past them); 0 without caches."""
        return 0

    def cache_reads_next_token(self) -> bool:
        """Whether this proposer's state at a slot depends on the token after it (an EAGLE
        head's cache pairs token i+1 with the target's feature at i): a prefix-cached page
        is then keyed by that token too (`jspec.serve.pages`)."""
        return False

    def init(self, plan, batch: int) -> Any:
        """The proposer's state for `batch` free rows."""
        return None

    def propose(self, plan, tw, pw, state, st, active):
        """A chain or tree under each row's root -> (state, `Tree` of plan.N nodes, the
        draft's log q [B,S,V] of sampled drafts (plan.sample_drafts) or None). st: the
        loop state (tokens, L, root, pages, request rows); active [B]: rows in this round."""
        raise NotImplementedError

    def observe(self, plan, tw, pw, state, obs: Observation):
        """The proposer's state after tokens were committed (`Observation`)."""
        return state
