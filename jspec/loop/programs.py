"""The loop's compiled entry points (static argument: the `Plan`).

  run       a fresh state, every request admitted, rounds to the end -> the state
  generate  `run` -> what the host reads
  start     a fresh state with requests admitted -> (state, readback)
  admit     requests into rows of a running state -> (state, readback)
  prefill   the next block of parked rows' prompts -> (state, readback)
  advance   rounds until every row finishes or a step count -> (state, readback)
  chunk     exactly a static number of rounds, no host read -> (state, readback)
  evict     rows freed -> state

`generate`, `Compiled.run` and `stream` are clients of these; a serving engine calls
`admit`, `prefill`, `chunk` and `evict` between chunks. The state is donated to the calls that
take one, so each updates it in place.
"""
from __future__ import annotations

import functools

import jax

from jspec.loop.plan import Plan
from jspec.loop.round import advance, advance_rounds
from jspec.loop.rows import admit, evict, prefill
from jspec.loop.state import Admission, LoopState, init_state, readback


def run(plan: Plan, tw, pw, rows, adm: Admission) -> LoopState:
    """A fresh state, the requests admitted into `rows`, rounds until every row finishes
    (or plan.max_rounds rounds) -> the final state."""
    st = admit(plan, tw, pw, init_state(plan), rows, adm)
    return advance(plan, tw, pw, st, plan.max_rounds)


def generate_fn(plan: Plan, tw, pw, rows, adm: Admission) -> dict:
    return readback(run(plan, tw, pw, rows, adm))


def start_fn(plan: Plan, tw, pw, rows, adm: Admission):
    st = admit(plan, tw, pw, init_state(plan), rows, adm)
    return st, readback(st)


def admit_fn(plan: Plan, tw, pw, st: LoopState, rows, adm: Admission):
    st = admit(plan, tw, pw, st, rows, adm)
    return st, readback(st)


def advance_fn(plan: Plan, tw, pw, st: LoopState, until):
    st = advance(plan, tw, pw, st, until)
    return st, readback(st)


def prefill_fn(plan: Plan, tw, pw, st: LoopState, rows, start):
    st = prefill(plan, tw, pw, st, rows, start)
    return st, readback(st)


def chunk_fn(plan: Plan, tw, pw, st: LoopState, rounds: int):
    st = advance_rounds(plan, tw, pw, st, rounds)
    return st, readback(st)


def evict_fn(plan: Plan, st: LoopState, rows) -> LoopState:
    return evict(plan, st, rows)


generate_jit = jax.jit(generate_fn, static_argnums=0)
start_jit = jax.jit(start_fn, static_argnums=0)
admit_jit = jax.jit(admit_fn, static_argnums=0, donate_argnums=3)
advance_jit = jax.jit(advance_fn, static_argnums=0, donate_argnums=3)
prefill_jit = jax.jit(prefill_fn, static_argnums=0, donate_argnums=3)

evict_jit = jax.jit(evict_fn, static_argnums=0, donate_argnums=1)
init_jit = jax.jit(init_state, static_argnums=0)


@functools.cache
def chunk_jit(rounds: int):
    """`chunk_fn` of `rounds` rounds, jitted (one entry point per count)."""
    return jax.jit(functools.partial(chunk_fn, rounds=rounds), static_argnums=0, donate_argnums=3)

