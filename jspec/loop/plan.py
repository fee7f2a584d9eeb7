"""What is static about one compiled generation (`Plan`) and its per-request inputs
(`LoopInputs`).

Every field of a Plan is part of the compile key: two calls share a program exactly when
their Plans are equal (and their weights have the same shapes and dtypes). The API builds
the Plan, by keyword, in one place (`jspec.api`), bucketing what varies from call to call
(batch, prompt length, round budget, stop-id count) so that similar calls share it.
Everything else a request brings is an array in `LoopInputs`, so new values never
recompile.
"""
from __future__ import annotations

import dataclasses

import jax
from flax import struct

from jspec.cache.layout import CacheLayout
from jspec.config import SpecConfig
from jspec.drafts.base import Draft
from jspec.models import family_for
from jspec.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class Plan:
    """target: the target's config (its family's config class); draft: the draft kind or
    None (plain decoding); spec: the draft's shape (None without a draft); layout: the
    caches' static shape; batch: B (bucketed); prompt_len: Tp (bucketed); max_rounds:
    the loop's round budget (bucketed); num_stop: Ks, stop-id slots (bucketed); sampling:
    does the program sample (False: every row greedy without penalties, and the sampling
    steps are left out; True: they run for every row, greedy rows included)."""

    target: object
    draft: Draft | None
    spec: SpecConfig | None
    layout: CacheLayout
    batch: int
    prompt_len: int
    max_rounds: int
    num_stop: int
    sampling: bool = False

    @property
    def family(self):
        return family_for(self.target)

    @property
    def N(self) -> int:
        return self.spec.num_draft_tokens if self.spec else 1

    @property
    def S(self) -> int:
        return self.spec.num_steps if self.spec else 0

    @property
    def K(self) -> int:
        return self.spec.topk if self.spec else 1

    @property
    def sample_drafts(self) -> bool:
        return bool(self.spec and self.spec.sample_drafts and self.sampling)

    @property
    def lag(self) -> int:
        return self.draft.lag if self.draft else 0

    @property
    def slack(self) -> int:
        return round_slack(self.target, self.draft, self.spec, self.layout.paged)

    @property
    def buffer_len(self) -> int:
        """Length of the token buffer: every slot, plus the bonus and a round's overshoot."""
        return self.layout.capacity + self.S + 2


def round_slack(target, draft: Draft | None, spec: SpecConfig | None, paged: bool) -> int:
    """Slots past L that one round may write (verify, draft steps, draft-extend), plus the
    room each cache kind asks past a forward's tokens (`extra_slots`)."""
    kinds = [family_for(target).cache_kind(target)] + ([draft.cache_kind()] if draft else [])

    def extra(T: int) -> int:  # room a forward writing T slots asks past them
        return max(k.extra_slots(T, paged) for k in kinds)

    if spec is None:
        return 1 + extra(1)
    S, K, N, lag = spec.num_steps, spec.topk, spec.num_draft_tokens, draft.lag
    # verify: N slots from L; draft-extend: S+1+lag from L; tree drafting: the K slots of
    # level j at L + lag + (j-1)K, j < S.
    return max(N + extra(N), S + 1 + lag + extra(S + 1 + lag), lag + (S - 1) * K + extra(K))


@struct.dataclass
class LoopInputs:
    """Per-request inputs of the loop (B rows, padded to the batch bucket; padding rows
    have real = False). Host numpy arrays until `jax.device_put`."""

    prompt: jax.Array  # [B, Tp] int32, right-padded
    prompt_len: jax.Array  # [B] int32
    max_new: jax.Array  # [B] int32 tokens to generate at most
    room_bound: jax.Array  # [B] bool: max_new was cut to the cache's room (ends as cache_full)
    slot_limit: jax.Array  # [B] int32 slots the request may use (beyond: cache_full)
    real: jax.Array  # [B] bool: a request, not batch padding
    sampling: SamplingParams  # [B] each: temperature, top-k/p, min-p, penalties, seed
    stop_ids: jax.Array  # [Ks] int32 (-1: unused slot)
