"""The serving engine's runner: the compiled programs and the device state of one batch of
rows, and nothing about requests' lifetimes (that is the scheduler's).

It makes its plan with `jspec.loop.plan.make_plan`, holds one loop state
(`jspec.loop.state`) and runs the loop's entry points on it (`jspec.loop.programs`):
admissions, prefill passes, chunks of rounds and evictions. Every program it can run is
listed by `programs_needed` and compiled by `compile_all` (the engine's warm-up: a server
compiles them before it listens, so nothing compiles while it serves). Their number does
not depend on the prompts' lengths: a prompt is passed in blocks of `prefill_chunk`
tokens, and an admission's prompt array has one of a few fixed widths (`widths`).

The programs, for a batch of B rows (A = 1, 2, 4, ... B an admission or prefill pass):
  admit    one per (A, width) with the sampling steps, and one per width of A = 1 that
           records the prompt's logprobs (such a request is admitted alone);
  admit_cached  one per A (prefix caching: requests that begin with a cached prefix);
  prefill  one per A, and one of A = 1 that records the prompt's logprobs (paged caches
           whose prompts are longer than a block); one per A of the narrower width
           (`narrow`, a prompt's short last block), and one of A = 1 of the wider width
           (`wide`, a lone prompt's blocks);
  chunk    one per tier x {greedy, sampling steps} x {logprobs recorded or not};
  evict    one;
  set_pages  one (paged caches);
  save_states, load_states  one each (prefix caching of a hybrid target's recurrent states).

With a paged cache the pool's pages are the host's (`CacheLayout.host_pages`): the
engine's scheduler hands them out and `set_pages` writes them into the page table before
the calls that use them.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import numpy as np

from jspec import requests as rq
from jspec import sharding
from jspec.config import CacheConfig, SpecConfig
from jspec.tuning import Tuning
from jspec.util import cdiv
from jspec.loop import programs
from jspec.loop.plan import make_plan, pool_for_memory, pow2, prompt_bucket, slot_limits
from jspec.loop.state import unpack_window
from jspec.constraints import tables as gt
from jspec.serve.grammar import ConstraintSlots
from jspec.models import family_for
from jspec.params import Params
from jspec.serve.tiers import buckets

NUM_STOP = 8  # stop ids a request may give (its own and the model's EOS ids together)
WIDE_BLOCKS = 8  # blocks a lone prompt's pass takes at most (`Runner.wide`)


class Runner:
    """The device side of an engine (see the module). params, cache, tuning: as
    `jspec.compile`; tiers: the SpecConfigs (None: plain rounds) the chunks may run;
    batch, max_prompt_len, max_new_tokens: the largest requests; prefill_chunk: prompt
    tokens a pass takes (used with paged caches of targets that take a prompt in blocks);
    rounds_per_chunk: rounds a chunk runs; max_logprobs: alternatives a logprob lists (0:
    no logprobs at all, and a smaller state); memory_utilization: with a paged cache of no
    given size, the pool takes the pages that fit in this share of the device's memory
    (`jspec.loop.plan.pool_for_memory`; at most every row's whole room; None: every row's
    whole room, whatever the memory); prefix_caching: prompts are passed in blocks wherever
    the cache is paged and a prefix's state lies in its pages (`prefix_in_pages`) or in
    snapshots of it (`state_snapshots`: a hybrid's, where blocks are whole pages), so that a
    request may start past a cached prefix (`admit_cached`); max_batched_tokens: with
    prompts in blocks, a pass takes at most this many tokens (rows of C: `pass_rows`;
    None: a pass may take every row); twin_chunks: each chunk program has a second loaded
    copy (`jspec.loop.programs.twin`) and chunks alternate between the two (on a GPU: no
    update of the chunk's CUDA graphs before each chunk, see `chunk`)."""

    def __init__(self, params: Params, *, batch: int, max_prompt_len: int, max_new_tokens: int, cache: CacheConfig,
                 tiers: Sequence[SpecConfig | None], tuning: Tuning, prefill_chunk: int, rounds_per_chunk: int,
                 max_logprobs: int, memory_utilization: float | None = None, prefix_caching: bool = False,
                 max_batched_tokens: int | None = None, grammar: tuple = (), twin_chunks: bool = False):
        self.pool_note = ""  # how the pool was sized, for the start-up log
        if cache.kind == "paged" and cache.num_pages is None and memory_utilization is not None:
            cache = self._pool_for_memory(params, batch, max_prompt_len, max_new_tokens, cache, tiers, tuning,
                                          prefill_chunk, max_logprobs, memory_utilization, prefix_caching, grammar)
        self.params, self.cache, self.rounds_per_chunk = params, cache, rounds_per_chunk
        self.max_prompt_len, self.max_new_tokens = max_prompt_len, max_new_tokens
        Tp = prompt_bucket(max_prompt_len)
        kind = family_for(params.config).cache_kind(params.config)
        paged = cache.kind == "paged"
        self.prefix_caching = bool(prefix_caching and paged and (kind.prefix_in_pages or (
            kind.state_snapshots and min(prefill_chunk, Tp) % cache.page_size == 0)))
        chunked = paged and kind.prefill_in_chunks and (prefill_chunk < Tp or self.prefix_caching)
        self.prefill_chunk = min(int(prefill_chunk), Tp) if chunked else 0  # 0: prompts passed whole
        # a hybrid's prefixes need their recurrent states: snapshots at prompt blocks' ends
        snapshots = 2 * pow2(batch) if self.prefix_caching and kind.state_snapshots else 0
        self.tiers = list(tiers)
        # Sized by the longest prompt and the most new tokens, on rows of their own (under a
        # cache's max_len a request's room is max_len less its prompt, not both at once).
        lens = [max_prompt_len] + [1] * (batch - 1)
        self.plan = make_plan(params, lens, [max_new_tokens] * batch, NUM_STOP, True, cache,
                              self.tiers[0], tuning, tiers=tuple(self.tiers) if len(self.tiers) > 1 else (),
                              prefill_chunk=self.prefill_chunk, logprobs=max_logprobs, host_pages=True,
                              snapshots=snapshots, grammar=grammar)
        self.slots = ConstraintSlots(*grammar, params.config.vocab_size) if grammar else None
        self.offsets: dict[str, int] = {}  # the placed automata's first states (`place_constraints`)
        self.batch = self.plan.batch
        # Rows a prompt pass takes at most (an admission or a block of C tokens each): the
        # activations of one pass stay within max_batched_tokens tokens, not batch x C.
        self.pass_rows = self.batch if not (self.prefill_chunk and max_batched_tokens) else \
            min(self.batch, max(1, max_batched_tokens // self.prefill_chunk))
        # A prompt's last block, where it holds at most a quarter of C tokens (a multiple of 8),
        # passes that narrower width: a request past a cached prefix is often only its tail.
        quarter = self.prefill_chunk // 4
        self.narrow = quarter if quarter >= 8 and quarter % 8 == 0 else 0
        self.narrow_passes = 0  # block passes that took it
        # A lone prompt (no row decoding) passes WIDE_BLOCKS blocks at once where a pass may take
        # that many tokens and a prompt can be that long: fewer engine iterations to its first token.
        # Not where prefixes need state snapshots (a hybrid's are saved at pass ends: its hits
        # would be fewer blocks deep).
        wide = self.prefill_chunk * min(WIDE_BLOCKS, self.pass_rows)
        self.wide = wide if (self.prefill_chunk and wide > self.prefill_chunk and wide // 2 < Tp
                             and not self.plan.layout.snapshots) else 0
        self.wide_passes = 0  # block passes that took it
        self.tier_plans = [self.plan.variant(spec=t) for t in self.tiers]
        self.state = None
        self._programs: dict = {}  # small keys -> compiled programs (a full key hashes every weight's shape)
        self.twin_chunks = bool(twin_chunks)
        self._twins: dict = {}  # chunk keys -> the chunk program's twin (`chunk`)
        self._chunk_parity = 0  # which copy the next chunk runs
        self.compile_s = 0.0
        self.launch_s = 0.0  # CPU time of the calling thread inside program calls (`_call`)

    def _pool_for_memory(self, params, batch, max_prompt_len, max_new_tokens, cache, tiers, tuning, prefill_chunk,
                         max_logprobs, utilization, prefix_caching, grammar) -> CacheConfig:
        """`cache` with the pool that fits in `utilization` of the device's memory (the
        plan's bytes, measured on a plan of a pool for one request). ValueError when not
        even the largest request's pages fit."""
        one = cdiv(max_prompt_len + max_new_tokens + 64, cache.page_size)
        small = Runner(params, batch=batch, max_prompt_len=max_prompt_len, max_new_tokens=max_new_tokens,
                       cache=dataclasses.replace(cache, num_pages=one), tiers=tiers, tuning=tuning,
                       prefill_chunk=prefill_chunk, rounds_per_chunk=1, max_logprobs=max_logprobs,
                       prefix_caching=prefix_caching, grammar=grammar)
        pages, note = pool_for_memory(params, small.plan, utilization)
        need = small.pages_needed(max_prompt_len, max_new_tokens)
        if pages < need:
            raise ValueError(f"the page pool that fits in memory holds {pages} pages of {cache.page_size} tokens "
                             f"({note}); the largest request (max_prompt_len={max_prompt_len} + max_new_tokens="
                             f"{max_new_tokens}) needs {need}: ask for shorter requests or a higher utilization")
        self.pool_note = note
        return dataclasses.replace(cache, num_pages=pages)

    @property
    def weights(self):
        return self.params.weights, self.params.draft.weights if self.params.draft is not None else None

    def put(self, tree):
        return sharding.replicated(self.params.mesh, tree)

    # ------------------------------------------------------------------ shapes

    def widths(self) -> list[int]:
        """The prompt widths of admissions: with blocks, up to 64 tokens, up to a block,
        and the longest prompt (whose later blocks are read from the token buffer); whole
        prompts: powers of two from 64 to the longest."""
        Tp, C = self.plan.prompt_len, self.prefill_chunk
        if C:
            return sorted({min(64, C), C, Tp})
        return sorted({min(w, Tp) for w in [64 << k for k in range(max(Tp // 64, 1).bit_length() + 1)]} | {Tp})

    def width_class(self, prompt_len: int) -> int:
        """The admission width of a prompt of this length."""
        return next(w for w in self.widths() if w >= prompt_len)

    def bucket(self, n: int) -> int:
        """The rows of a pass (an admission or a prefill block) of n rows."""
        return min(pow2(n), self.pass_rows)

    def pages_needed(self, prompt_len: int, max_new: int) -> int:
        """Pages a request may come to hold (its slot limit: prompt, max_new and a round's
        slack, as `jspec.requests.pack` sets it); 0 with a dense cache, whose rows hold
        their own regions."""
        lay = self.plan.layout
        if not lay.paged:
            return 0
        return self.pages_at(prompt_len, max_new, lay.capacity)

    def pages_at(self, prompt_len: int, max_new: int, slots: int) -> int:
        """Pages that hold `slots` slots of such a request, within its slot limit."""
        lay = self.plan.layout
        if not lay.paged:
            return 0
        limit = slot_limits(self.cache, [prompt_len], [max_new], self.plan.slack)[0][0]
        return cdiv(min(slots, limit, lay.capacity), lay.page_size)

    # ------------------------------------------------------------------ programs

    def _program(self, key, entry, plan, args):
        if key not in self._programs:
            self._programs[key], seconds = programs.compiled(entry, plan, self.weights, args, self.params.mesh)
            self.compile_s += seconds
        return self._programs[key]

    def _call(self, program, *args):
        """program(weights, *args); the calling thread's CPU time in the call (the dispatch:
        on a GPU without command buffers, every kernel's launch) adds to `launch_s`."""
        t0 = time.thread_time()
        out = program(*self.weights, *args)
        self.launch_s += time.thread_time() - t0
        return out

    def _admit_inputs(self, rows: list[int], reqs: rq.Requests, width: int, stops: list[int] | None = None):
        A = self.bucket(len(rows))
        packed_rows, adm = rq.pack(self.plan, reqs, self.cache, self.offsets if self.slots is not None else None)
        packed_rows[:len(rows)] = rows
        adm = adm.replace(prompt=adm.prompt[:, :width])
        return self.put((packed_rows[:A], jax.tree.map(lambda a: a[:A], adm), self._stops(A, stops)))

    @staticmethod
    def _stops(A: int, stops: list[int] | None) -> np.ndarray:
        """[A] the slots the rows' passes stop at (`jspec.loop.rows.prompt_pass`; None or
        padding: none before their blocks' ends)."""
        out = np.full((A,), np.iinfo(np.int32).max, np.int32)
        out[:len(stops or ())] = stops or ()
        return out

    def admit(self, rows: list[int], reqs: rq.Requests, prompt_logprobs: bool = False,
              stops: list[int] | None = None):
        """Dispatches the admission of requests `reqs` (one per row of `rows`) -> its window
        readback (on the device). Their prompts' first blocks are passed, each up to its
        slot of `stops` at most (None: whole blocks)."""
        width = self.width_class(max(reqs.lens))
        args = (self.state, *self._admit_inputs(rows, reqs, width, stops))
        plan = self.plan.variant(sampling=True, prompt_logprobs=prompt_logprobs)
        program = self._program(("admit", len(args[1]), width, prompt_logprobs), programs.admit_jit, plan, args)
        self.state, back = self._call(program, *args)
        return back

    def prefill(self, blocks: list[tuple[int, int]], width: int | None = None, prompt_logprobs: bool = False,
                stops: list[int] | None = None):
        """Dispatches the next block of parked rows: (row, first slot of the block) each ->
        the window readback. width: the block's tokens, `prefill_chunk` (None), `narrow`
        (every prompt ends within it) or `wide` (one row); stops: the slot each row's block
        stops at, if before its end (None: whole blocks)."""
        width = width or self.prefill_chunk
        if width not in (self.prefill_chunk, self.narrow, self.wide) or (width == self.wide and len(blocks) > 1):
            raise ValueError(f"no prefill program of {len(blocks)} rows of {width} tokens")
        A = self.bucket(len(blocks))
        rows = np.full((A,), self.batch, np.int32)
        start = np.zeros((A,), np.int32)
        rows[:len(blocks)] = [r for r, _ in blocks]
        start[:len(blocks)] = [s for _, s in blocks]
        args = (self.state, *self.put((rows, start, self._stops(A, stops))))
        self.narrow_passes += width < self.prefill_chunk
        self.wide_passes += width > self.prefill_chunk
        plan = self.plan.variant(sampling=True, prompt_logprobs=prompt_logprobs, prefill_chunk=width)
        program = self._program(("prefill", A, prompt_logprobs, width), programs.prefill_jit, plan, args)
        self.state, back = self._call(program, *args)
        return back

    def admit_cached(self, rows: list[int], reqs: rq.Requests) -> None:
        """Dispatches the admission of requests whose prompts begin with a prefix already in
        their rows' pages (`set_pages`): set up and parked, no pass. A call per pass_rows
        requests (their prompt arrays are the longest prompt's width)."""
        P = self.pass_rows
        for i in range(0, len(rows), P):
            rows_dev, adm, _ = self._admit_inputs(rows[i:i + P], reqs.take(range(i, min(i + P, len(rows)))),
                                                  self.plan.prompt_len)
            args = (self.state, rows_dev, adm)
            program = self._program(("admit_cached", len(rows_dev)), programs.admit_cached_jit, self.plan, args)
            self.state = self._call(program, *args)

    def page_updates(self) -> int:
        """Entries a `set_pages` call takes (one program): at least a chunk's growth of every
        row; an admission of many pages takes several calls."""
        lay = self.plan.layout
        return max(1024, pow2(self.batch * (cdiv(self.rounds_per_chunk * self.plan.slack, lay.page_size) + 1)))

    def set_pages(self, updates: list[tuple[int, int, int]]) -> None:
        """Dispatches page-table entries (row, column, page): the host's pages."""
        U = self.page_updates()
        for i in range(0, len(updates), U):
            part = updates[i:i + U]
            rows = np.full((U,), self.batch, np.int32)
            cols, pages = np.zeros((U,), np.int32), np.zeros((U,), np.int32)
            rows[:len(part)], cols[:len(part)], pages[:len(part)] = zip(*part)
            args = self.put((rows, cols, pages))
            program = self._program(("set_pages",), programs.set_pages_jit, self.plan, (self.state, *args))
            self.state = self._call(program, self.state, *args)

    def save_states(self, pairs: list[tuple[int, int]]) -> None:
        """Dispatches the saving of rows' recurrent states into snapshots: (row, slot) each."""
        self._states(pairs, "save_states", programs.save_states_jit)

    def load_states(self, pairs: list[tuple[int, int]]) -> None:
        """Dispatches the restoring of snapshots into rows' recurrent states: (row, slot) each."""
        self._states(pairs, "load_states", programs.load_states_jit)

    def _states(self, pairs, name, entry):
        rows = np.full((self.batch,), self.batch, np.int32)
        slots = np.full((self.batch,), self.plan.layout.snapshots, np.int32)
        rows[:len(pairs)], slots[:len(pairs)] = zip(*pairs)
        args = self.put((rows, slots))
        program = self._program((name,), entry, self.plan, (self.state, *args))
        self.state = self._call(program, self.state, *args)

    def chunk(self, tier: int, sampled: bool, logprobs: bool):
        """Dispatches `rounds_per_chunk` rounds of tier `tier` -> the window readback.

        With `twin_chunks`, every other chunk runs the program's twin. The engine keeps two
        chunks in flight, so a chunk's readback is still held when the next is dispatched
        and the allocator puts that one's outputs elsewhere; XLA shares an output's memory
        with the loop's temporaries, so its CUDA graphs reference the output, and a program
        whose output moved updates its graphs before it runs (on an H200, by XLA's own
        timing 0.6 ms a 6 ms chunk of the 8B shape cut to 8 layers; the whole 8B engine's
        thread spent 0.3-0.4 ms a 23 ms chunk less with twins). Alternating two copies,
        each finds its outputs where its last chunk, read by then, left them."""
        key = ("chunk", tier, sampled, logprobs)
        plan = self.tier_plans[tier].variant(sampling=sampled, token_logprobs=logprobs)
        program = self._program(key, programs.chunk_jit(self.rounds_per_chunk), plan, (self.state,))
        if self.twin_chunks:
            self._chunk_parity ^= 1
            program = self._twin(key, program) if self._chunk_parity else program
        self.state, back = self._call(program, self.state)
        return back

    def _twin(self, key, program):
        """The twin of chunk program `program` (made once; the program itself where it has none)."""
        if key not in self._twins:
            self._twins[key] = programs.twin(program) or program
        return self._twins[key]

    def evict(self, rows: list[int]) -> None:
        """Dispatches the eviction of `rows` (pages back to the pool, the rows free)."""
        padded = np.full((self.batch,), self.batch, np.int32)
        padded[:len(rows)] = rows
        rows_dev = self.put(padded)
        program = self._program(("evict",), programs.evict_jit, self.plan, (self.state, rows_dev))
        self.state = self._call(program, self.state, rows_dev)

    def reset(self) -> None:
        """A fresh state: every row free (and no constraint placed)."""
        with programs.under(self.params.mesh):
            self.state = programs.init_jit(self.plan)
        if self.slots is not None:
            self.slots = ConstraintSlots(self.slots.Q, self.slots.E, self.slots.V)
            self.offsets = {}

    def place_constraints(self, automata, held: set[str]) -> None:
        """The automata of requests about to be admitted placed in the constraint tables
        (`jspec.serve.grammar`; `held`: the keys running rows hold); new ones go to the
        device's tables before the admission. ValueError if they cannot fit."""
        automata = [a for a in automata if a is not None]
        if self.slots is None:
            if automata:
                raise ValueError("this engine takes no constraints (Engine(constraint_states=0))")
            return
        self.offsets = self.slots.place(automata, held)
        for rows in self.slots.take_rows(*self.grammar_chunk):
            args = (self.state, self.put(rows))
            program = self._program(("set_grammar",), programs.set_grammar_jit, self.plan, args)
            self.state = self._call(program, *args)

    @property
    def grammar_chunk(self) -> tuple[int, int]:
        """(states, exceptions) a `set_grammar` call writes."""
        return min(self.slots.Q, 256), min(self.slots.E, 16384)

    # ------------------------------------------------------------------ start-up

    def programs_needed(self, widths=None, sampled=(False, True), logprobs=None) -> list[tuple]:
        """(key, entry, plan, args) of every program (see the module): admissions of the
        given widths (None: all), chunks with these sampling variants, admissions and chunks
        with these logprob variants (recording prompt and token logprobs; None: both where
        the state keeps logprobs)."""
        logprobs = ((False, True) if self.plan.logprobs else (False,)) if logprobs is None else logprobs
        dummy = rq.check_requests(self.params, [[1]] * self.batch, [1] * self.batch, [], {})
        out = []
        for A in buckets(self.pass_rows):
            for lp in logprobs if A == 1 else (False,):  # prompt logprobs: requests admitted one at a time
                plan = self.plan.variant(sampling=True, prompt_logprobs=lp)
                for width in widths or self.widths():
                    args = (self.state, *self._admit_inputs(list(range(A)), dummy.take(range(A)), width))
                    out.append((("admit", A, width, lp), programs.admit_jit, plan, args))
                if self.prefill_chunk:
                    args = (self.state, *self.put((np.zeros((A,), np.int32), np.zeros((A,), np.int32),
                                                   self._stops(A, None))))
                    others = (self.narrow, self.wide if A == 1 else 0) if not lp else ()
                    for width in [self.prefill_chunk] + [w for w in others if w]:
                        out.append((("prefill", A, lp, width), programs.prefill_jit,
                                    plan.variant(prefill_chunk=width), args))
        for tier, plan in enumerate(self.tier_plans):
            for s in sampled:
                for lp in logprobs:
                    out.append((("chunk", tier, s, lp), programs.chunk_jit(self.rounds_per_chunk),
                                plan.variant(sampling=s, token_logprobs=lp), (self.state,)))
        out.append((("evict",), programs.evict_jit, self.plan,
                    (self.state, self.put(np.zeros((self.batch,), np.int32)))))
        if self.plan.layout.paged:
            args = self.put((np.zeros((self.page_updates(),), np.int32),) * 3)
            out.append((("set_pages",), programs.set_pages_jit, self.plan, (self.state, *args)))
        if self.slots is not None:
            rows = gt.rows_of(self.slots.host, 0, 0, 0, 0, *self.grammar_chunk)[0]  # writes nothing
            out.append((("set_grammar",), programs.set_grammar_jit, self.plan, (self.state, self.put(rows))))
        if self.plan.layout.snapshots:
            args = self.put((np.zeros((self.batch,), np.int32),) * 2)
            out += [(("save_states",), programs.save_states_jit, self.plan, (self.state, *args)),
                    (("load_states",), programs.load_states_jit, self.plan, (self.state, *args))]
        if self.prefix_caching:
            for A in buckets(self.pass_rows):
                args = (self.state, *self._admit_inputs(list(range(A)), dummy.take(range(A)), self.plan.prompt_len)[:2])
                out.append((("admit_cached", A), programs.admit_cached_jit, self.plan, args))
        return out

    def compile_all(self, threads: int | None = None, **which) -> tuple[int, float]:
        """Compiles `programs_needed(**which)`, `threads` at a time (None: the default of
        `jspec.loop.programs.compile_many`), and runs each once on placeholder inputs, then
        starts from a fresh state -> (how many, seconds; programs compiled before cost only
        their run). The run matters on a GPU: a program's first call loads its kernels and
        builds its cuDNN plans (0.4 s of the first pass of 31 rows of 512 tokens on the 8B
        shape, H200), which would otherwise fall on a request."""
        if self.state is None:
            self.reset()
        t0 = time.perf_counter()
        needed = self.programs_needed(**which)
        todo = [n for n in needed if n[0] not in self._programs]
        made = programs.compile_many([n[1:] for n in todo], self.weights, self.params.mesh, threads)
        for (key, *_), (program, seconds) in zip(todo, made):
            self._programs[key] = program
            self.compile_s += seconds
        if self.twin_chunks:  # the chunks' twins load (in threads) and run once too
            keys = [key for key, *_ in needed if key[0] == "chunk" and key not in self._twins]
            for key, twin in zip(keys, programs.twins([self._programs[k] for k in keys], threads)):
                self._twins[key] = twin or self._programs[key]
        state = self.state  # every program's args begin with the state, which each call donates
        for key, _, _, args in needed:
            copies = [self._programs[key]]
            if self.twin_chunks and key[0] == "chunk":
                copies.append(self._twins[key])
            for program in copies:
                out = program(*self.weights, state, *args[1:])
                state = out[0] if isinstance(out, tuple) else out
        jax.block_until_ready(state)
        self.reset()
        return len(needed), time.perf_counter() - t0

    def time_rounds(self, tier: int, n: int, context: int, repeats: int) -> float:
        """Seconds a round of tier `tier` takes with n rows running placeholder requests
        whose prompts hold `context` tokens: admitted into an idle state, a warm-up chunk,
        `repeats` timed chunks, then evicted (`jspec.serve.tiers.measure_costs`); with a page
        pool too small for n such rows, shorter prompts. No row may end while timed (an
        ended row's rounds cost less, and rows whose drafts are all accepted commit
        max_emit tokens a round): fewer timed chunks where the engine's
        max_new_tokens would not last the warm-up and `repeats` chunks at max_emit a round."""
        if self.state is None:
            self.reset()
        per_chunk = self.rounds_per_chunk * self.plan.max_emit  # the most tokens a chunk commits a row
        repeats = max(1, min(repeats, self.max_new_tokens // per_chunk - 1))
        max_new = max(1, min(self.max_new_tokens, per_chunk * (repeats + 1)))
        lay = self.plan.layout
        if lay.paged:  # a small pool: shorter placeholder prompts, so that the n rows fit it
            context = min(context, (lay.num_pages // n) * lay.page_size - max_new - self.plan.slack)
        prompt = [1 + (i % 97) for i in range(max(1, min(context, self.max_prompt_len)))]
        reqs = rq.check_requests(self.params, [prompt] * n, max_new, [], {})
        rows = list(range(n))
        if lay.paged:  # the pool is idle (nothing cached yet): row i takes the i-th run of pages
            per = self.pages_needed(len(prompt), max_new)
            self.set_pages([(r, j, r * per + j) for r in rows for j in range(per)])
        P = self.pass_rows
        for i in range(0, n, P):
            jax.block_until_ready(self.admit(rows[i:i + P], reqs.take(range(i, min(i + P, n)))))
        for start in range(self.prefill_chunk, len(prompt), self.prefill_chunk) if self.prefill_chunk else ():
            for i in range(0, n, P):
                self.prefill([(r, start) for r in rows[i:i + P]])
        step = lambda back: int(unpack_window(jax.device_get(back))["step"])  # noqa: E731
        step0 = step(self.chunk(tier, False, False))
        t0 = time.perf_counter()
        for _ in range(repeats):
            back = self.chunk(tier, False, False)
        step1 = step(back)
        seconds = time.perf_counter() - t0
        self.evict(rows)
        return seconds / max(step1 - step0, 1)
