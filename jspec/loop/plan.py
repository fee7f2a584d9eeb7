"""What is static about one compiled loop (`Plan`), and the one place a Plan is made
(`make_plan`).

Every field of a Plan is part of the compile key: two calls share a program exactly when
their Plans are equal (and their weights have the same shapes and dtypes). `make_plan`
buckets what varies from call to call (batch, prompt length, round budget, stop-id count)
so that similar calls share it, sizes the caches and refuses a plan that cannot fit in
memory. Everything a request brings is a row of the loop state (`jspec.loop.state`), so
new values never recompile.
"""
from __future__ import annotations

import dataclasses
import math
import os

import jax
import numpy as np

from jspec.cache.layout import CacheLayout
from jspec.config import CacheConfig, SpecConfig
from jspec.tuning import DEFAULT_TUNING, Tuning
from jspec.drafts.base import Draft
from jspec.loop.proposers.base import Proposer
from jspec.loop.proposers.block import BlockProposer
from jspec.loop.proposers.neural import NeuralProposer
from jspec.models import family_for
from jspec.util import cdiv, round_up


@dataclasses.dataclass(frozen=True)
class Plan:
    """target: the target's config (its family's config class); proposer: the draft side
    of a round (None: plain decoding); spec: the drafts' shape (None without a proposer);
    layout: the caches' static shape; batch: B, request rows (bucketed); prompt_len: Tp,
    the longest prompt an admission takes (bucketed); max_rounds: rounds a row keeps in
    its accept-length history, and the round budget of `generate` (bucketed); num_stop:
    Ks, stop-id slots per row (bucketed); sampling: does the program sample (False: every
    row greedy without penalties, and the sampling steps are left out; True: they run for
    every row, greedy rows included); tuning: how kernels and XLA compute it.

    tiers: the speculation tiers whose plans share this plan's state (a serving engine
    switching between them, `jspec.serve.tiers`): every SpecConfig among them sizes the
    slack and the token buffer, and None among them is a tier of plain rounds that keeps
    the proposer observing. A plan with a proposer and spec None is such a plain tier.
    Admissions, prefill passes and evictions do not depend on the tier (any of the plans
    runs them).
    prefill_chunk: C, the prompt tokens an admission's pass takes (`jspec.loop.rows`; 0:
    the whole prompt, Tp, in one pass); the rest of a prompt C tokens a pass, by the
    engine between chunks or by `generate`'s program in a loop (`rows.prefill_rest`).

    logprobs: k, the alternatives a position's log-probabilities keep (0: the state keeps
    none, `LoopState.logprobs` is None); token_logprobs: rounds record the log-probabilities
    of the tokens they emit (a prompt pass records the first token's whenever k > 0);
    prompt_logprobs: prompt passes record the prompt tokens' too. Both are variants of one
    state (`variant`), as `sampling` is.

    grammar: (Q, E), the capacities of the constraints' tables (`jspec.constraints.tables`:
    states and exceptions; () : no constraints, `LoopState.grammar` is None)."""

    target: object
    proposer: Proposer | None
    spec: SpecConfig | None
    layout: CacheLayout
    batch: int
    prompt_len: int
    max_rounds: int
    num_stop: int
    sampling: bool = False
    tuning: Tuning = DEFAULT_TUNING
    tiers: tuple = ()
    prefill_chunk: int = 0
    logprobs: int = 0
    token_logprobs: bool = False
    prompt_logprobs: bool = False
    grammar: tuple = ()

    def variant(self, *, spec=..., sampling=None, token_logprobs=None, prompt_logprobs=None,
                prefill_chunk=None) -> "Plan":
        """The plan of another program over the same state: a tier (`spec`, one of `spec`
        and `tiers`), with or without the sampling steps, recording logprobs or not, or
        passing prompt blocks of another width (a narrower last block: `rows.prefill`)."""
        changes = {k: v for k, v in (("sampling", sampling), ("token_logprobs", token_logprobs),
                                     ("prompt_logprobs", prompt_logprobs), ("prefill_chunk", prefill_chunk))
                   if v is not None}
        if spec is not ...:
            if spec not in (self.spec, *self.tiers):
                raise ValueError(f"{spec} is not a tier of this plan")
            changes["spec"] = spec
        if (changes.get("token_logprobs") or changes.get("prompt_logprobs")) and not self.logprobs:
            raise ValueError("this plan's state keeps no logprobs (Plan.logprobs is 0)")
        return dataclasses.replace(self, **changes)

    def verifying(self, length: int) -> "Plan":
        """The plan of a round that verifies the first `length` drafts of this plan's chain
        (`SpecConfig.verify_lengths`, `jspec.loop.budget`); the state's shapes (slack,
        token buffer) stay this plan's."""
        spec = SpecConfig(num_steps=length, topk=1, sample_drafts=self.spec.sample_drafts)
        return dataclasses.replace(self, spec=spec, tiers=(self.spec, *self.tiers))

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
    def capture(self) -> tuple[int, ...]:
        """Target layers whose inputs the verification captures for the proposer."""
        return self.proposer.target_layers() if self.proposer is not None else ()

    @property
    def drafts(self) -> bool:
        """Does a round draft (a proposer and a SpecConfig; a plain tier does not)?"""
        return self.proposer is not None and self.spec is not None

    @property
    def slack(self) -> int:
        return max(round_slack(self.target, self.proposer, s, self.layout.paged) for s in (self.spec, *self.tiers))

    @property
    def max_emit(self) -> int:
        """The most tokens a round emits per row (the deepest tier's S + 1)."""
        return max(s.num_steps if s else 0 for s in (self.spec, *self.tiers)) + 1

    @property
    def buffer_len(self) -> int:
        """Length of the token buffer: every slot, plus the bonus and a round's overshoot
        (the largest of every tier's)."""
        return self.layout.capacity + self.max_emit + 1


def proposer_for(draft) -> Proposer | None:
    """The proposer of a loaded draft's config: a draft model kind is wrapped by the
    neural proposer, a block drafter (`Draft.proposes_blocks`) by the block proposer; a
    proposer (`jspec.NgramDraft`) is itself; None: plain decoding."""
    if draft is None or isinstance(draft, Proposer):
        return draft
    if isinstance(draft, Draft):
        return BlockProposer(draft) if draft.proposes_blocks else NeuralProposer(draft)
    raise TypeError(f"not a draft: {type(draft).__name__}")


def round_slack(target, proposer: Proposer | None, spec: SpecConfig | None, paged: bool) -> int:
    """Slots past L that one round may write (the verification's N, the proposer's own
    forwards), plus the room each cache kind asks past a forward's tokens (`extra_slots`).
    spec None with a proposer: a plain tier (the proposer still observes each round)."""
    N = spec.num_draft_tokens if spec else 1
    verify = N + family_for(target).cache_kind(target).extra_slots(N, paged)
    return max(verify, proposer.slack(spec, paged)) if proposer is not None else verify


def pow2(n: int, lo: int = 1) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def prompt_bucket(n: int) -> int:
    return pow2(n, 16) if n <= 512 else round_up(n, 256)


def slot_limits(cache: CacheConfig, lens: list[int], max_new: list[int], slack: int):
    """-> (slots each request may use, max_new cut to the cache's room, was it cut)."""
    if cache.max_len is None:
        return [l + m + slack for l, m in zip(lens, max_new)], list(max_new), [False] * len(lens)
    too_long = [i for i, l in enumerate(lens) if l >= cache.max_len]
    if too_long:
        i = too_long[0]
        raise ValueError(f"prompt {i} has {lens[i]} tokens, which does not fit a cache of max_len="
                         f"{cache.max_len} (it needs room for at least one generated token)")
    room = [cache.max_len - l for l in lens]  # a request holds at most max_len tokens
    new = [min(r, m) for r, m in zip(room, max_new)]
    return [l + n + slack for l, n in zip(lens, new)], new, [r < m for r, m in zip(room, max_new)]


def make_plan(params, lens: list[int], max_new: list[int], num_stop: int, samples: bool, cache: CacheConfig,
              spec: SpecConfig | None, tuning: Tuning = DEFAULT_TUNING, tiers: tuple = (),
              prefill_chunk: int | None = None, logprobs: int = 0, token_logprobs: bool = False,
              prompt_logprobs: bool = False, host_pages: bool = False,
              snapshots: int = 0, grammar: tuple = ()) -> Plan:
    """The Plan for requests of these prompt lengths and limits: buckets for batch, prompt
    length, rounds and stop ids; caches sized for them (or for `cache`'s max_len and
    num_pages); refused with a ValueError when it cannot fit in memory. tiers,
    prefill_chunk, logprobs, token_logprobs, prompt_logprobs: see `Plan`. host_pages: the
    caller hands out the pool's pages and admits requests only while theirs fit
    (`CacheLayout.host_pages`, the serving engine); snapshots: `CacheLayout.snapshots`;
    grammar: `Plan.grammar`.

    prefill_chunk None (`generate`'s programs, which admit every request at once): blocks
    of C = `row_block(tuning, B)` tokens a row where the target's cache takes a prompt in
    blocks and the longest prompt (with `cache.max_len`: the longest it allows) is longer
    than a block; then Tp is that length rounded up to whole blocks, so with max_len one
    program takes every prompt length."""
    proposer = proposer_for(params.draft.config if params.draft is not None else None)
    paged = cache.kind == "paged"
    family = family_for(params.config)
    problem = family.row_invariant_problem(params.config, tuning)
    if params.mesh is not None:
        problem = "it runs on one device: its kernels cannot be split over a mesh"
    if cache.dtype is not None and not family.cache_kind(params.config).fp8_row_kernels:
        problem = "an FP8 latent cache (CacheConfig.dtype) is read by the jnp attention, not the row kernels"
    if tuning.row_invariant is None:  # auto: where the family measured it cheap (`TargetFamily.row_invariant_by_default`)
        tuning = tuning.replace(row_invariant=problem is None and family.row_invariant_by_default(
            params.config, pow2(len(lens)), jax.devices()[0]))
    if tuning.row_invariant and problem:
        raise ValueError(f"Tuning(row_invariant=True): {problem}")
    in_blocks = family.cache_kind(params.config).prefill_in_chunks
    longest = max(max(lens), cache.max_len - 1 if cache.max_len else 0)
    B = pow2(len(lens))
    if prefill_chunk is None:
        C = row_block(tuning, B)
        prefill_chunk = C if C and in_blocks and longest > C else 0
        Tp = round_up(longest, C) if prefill_chunk else prompt_bucket(max(lens))
    elif prefill_chunk and not (paged and in_blocks):
        raise ValueError("prefill in chunks needs a paged cache and a target whose cache takes a prompt in blocks")
    else:
        Tp = prompt_bucket(max(lens))
    slack = max(round_slack(params.config, proposer, s, paged) for s in (spec, *tiers))
    limits, max_new, _ = slot_limits(cache, lens, max_new, slack)
    P = cache.page_size
    if paged:
        capacity = round_up(max(max(limits), Tp), P)
        num_pages = cache.num_pages if cache.num_pages is not None else capacity // P * B
        for i, l in enumerate(lens if not host_pages else ()):  # the host refuses what cannot fit
            if cdiv(l + slack, P) > num_pages:
                raise ValueError(f"prompt {i} needs {cdiv(l + slack, P)} pages of {P} tokens but the pool "
                                 f"has num_pages={num_pages}")
        layout = CacheLayout(paged=True, capacity=capacity, page_size=P, num_pages=num_pages, host_pages=host_pages,
                             snapshots=snapshots, kv_dtype=cache.dtype)
    else:
        layout = CacheLayout(paged=False, capacity=round_up(max(max(limits), Tp), 64), kv_dtype=cache.dtype)
    plan = Plan(target=params.config, proposer=proposer, spec=spec, layout=layout, batch=B, prompt_len=Tp,
                max_rounds=pow2(max(max_new), 8), num_stop=pow2(num_stop, 4), sampling=samples, tuning=tuning,
                tiers=tuple(tiers), prefill_chunk=prefill_chunk, logprobs=logprobs,
                token_logprobs=bool(token_logprobs and logprobs), prompt_logprobs=bool(prompt_logprobs and logprobs),
                grammar=tuple(grammar))
    check_memory(params, plan, max(max_new))
    return plan


def row_block(tuning: Tuning, batch: int) -> int:
    """The prompt tokens a row's pass takes in `generate`'s programs of `batch` rows:
    `tuning.prefill_block`, and no more than the row's share of `tuning.max_batched_tokens`
    (a multiple of 16, at least 16); 0 (prefill_block 0): whole prompts."""
    C = tuning.prefill_block
    if C and tuning.max_batched_tokens:
        C = min(C, max(16, tuning.max_batched_tokens // batch // 16 * 16))
    return C


# ----------------------------------------------------------------------------- memory

def nbytes(tree) -> int:
    """Bytes of a pytree of arrays (or of shape-dtype structs)."""
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def shard_bytes(a) -> int:
    """Bytes of an array on one device: its first shard's (all of it when not split)."""
    shards = getattr(a, "addressable_shards", None)
    return shards[0].data.nbytes if shards else nbytes(a)


def plan_bytes(plan: Plan) -> int:
    """Bytes of the loop's buffers that grow with the plan: the target's cache and the
    proposer's state (a draft's cache, dense or paged, as the kinds allocate them), the
    token buffer and the accept-length history. Activations are left out: a lower bound."""
    B = plan.batch
    kind = plan.family.cache_kind(plan.target)
    shapes = jax.eval_shape(lambda: (kind.init(plan.layout, B),  # shapes only, nothing allocated
                                     plan.proposer.init(plan, B) if plan.proposer is not None else None))
    hist = plan.max_rounds if plan.proposer is not None else 0
    k = plan.logprobs
    logprobs = 4 * B * plan.buffer_len * (1 + 2 * k) if k else 0  # chosen, top ids and values, 4 bytes each
    grammar = 0
    if plan.grammar:  # the constraints' tables: bitmasks [Q, V / 32], four [Q] and two [E] columns
        Q, E = plan.grammar
        grammar = 4 * (Q * (-(-plan.target.vocab_size // 32) + 4) + 2 * E)
    return nbytes(shapes) + 4 * B * (plan.buffer_len + hist) + logprobs + grammar  # tokens, hist


def device_memory() -> tuple[int, str] | None:
    """(bytes, what) generation may fill: the default device's `bytes_limit` where jax
    reports one (GPUs), else the machine's physical memory (CPU); None if neither is known."""
    dev = jax.devices()[0]
    try:
        limit = (dev.memory_stats() or {}).get("bytes_limit")
    except Exception:  # backends without memory statistics
        limit = None
    if limit:
        return int(limit), f"{dev.platform.upper()} device {dev.id}"
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's physical memory"
    except (AttributeError, OSError, ValueError):
        return None


def weight_bytes(params) -> int:
    """Bytes of the target's and the draft's weights on one device (an array held twice
    counts once)."""
    leaves = jax.tree.leaves((params.weights, params.draft.weights if params.draft is not None else None))
    return sum(shard_bytes(a) for a in {id(a): a for a in leaves}.values())


def device_plan_bytes(params, plan: Plan) -> int:
    """`plan_bytes` on one device: KV caches split by head over a mesh, latent ones not."""
    split = params.mesh is not None and plan.family.cache_kind(plan.target).split_by_head
    return plan_bytes(plan) // (params.mesh.size if split else 1)


def with_pages(plan: Plan, n: int) -> Plan:
    """A paged plan with a pool of n pages."""
    return dataclasses.replace(plan, layout=dataclasses.replace(plan.layout, num_pages=n))


def page_bytes(params, plan: Plan) -> int:
    """Bytes one page of a paged plan's pool takes on a device (every cache's share)."""
    return device_plan_bytes(params, with_pages(plan, 1)) - device_plan_bytes(params, with_pages(plan, 0))


def pool_for_memory(params, plan: Plan, utilization: float) -> tuple[int, str]:
    """The pages of a paged plan's pool that fit in `utilization` of the device's memory
    beside the weights and the loop's other buffers (a plan's bytes are linear in its
    pages), at most every row's whole room -> (pages, how the number came: the bytes).
    Activations are not counted: 1 - utilization is their headroom. ValueError when the
    device's memory is not known."""
    have = device_memory()
    if have is None:
        raise ValueError("the device's memory is not known: give the pool's size (CacheConfig(num_pages=...))")
    limit, where = have
    lay = plan.layout
    base = device_plan_bytes(params, with_pages(plan, 0))
    per_page = page_bytes(params, plan)
    room = int(utilization * limit) - weight_bytes(params) - base
    pages = max(min(room // per_page, plan.batch * lay.pages_per_seq), 0)
    gib = lambda b: f"{b / 2 ** 30:,.1f} GiB"  # noqa: E731
    return pages, (f"{gib(pages * per_page)} of {where}'s {gib(limit)} at utilization {utilization}, beside "
                   f"{gib(weight_bytes(params))} of weights")


def check_memory(params, plan: Plan, max_new: int) -> None:
    """Refuses a plan whose caches and token buffers, with the weights, exceed the device's
    memory: a clear error now instead of an out-of-memory error from XLA after compiling."""
    have = device_memory()
    if have is None:
        return
    limit, where = have
    need, weights = device_plan_bytes(params, plan), weight_bytes(params)
    if need + weights > limit:
        gib = lambda b: f"{b / 2 ** 30:,.1f} GiB"  # noqa: E731
        lay = plan.layout
        what = (f"a pool of {lay.num_pages} pages of {lay.page_size} tokens" if lay.paged else
                f"{plan.batch} request slots of {lay.capacity} tokens")
        raise ValueError(f"max_new_tokens={max_new} does not fit in memory: the caches and token buffers ({what}) "
                         f"need about {gib(need)} plus {gib(weights)} of weights, but {where} has {gib(limit)}; "
                         f"ask for a smaller max_new_tokens, or cap each request with CacheConfig(max_len=...)"
                         + (" or the pool with a smaller num_pages" if lay.paged else ""))
