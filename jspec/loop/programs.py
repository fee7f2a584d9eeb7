"""The loop's compiled entry points (static argument: the `Plan`).

  run       a fresh state, every request admitted, rounds to the end -> the state
  generate  `run` -> what the host reads
  start     a fresh state with requests admitted and their prompts prefilled (in blocks
            of `Plan.prefill_chunk` where it is set) -> (state, readback)
  admit     requests into rows of a running state -> (state, window readback)
  admit_cached  requests whose prompts begin with a cached prefix into rows, set up and
            parked with no pass (their blocks come as `prefill`) -> state
  set_pages the host's pages into rows' page tables (`CacheLayout.host_pages`) -> state
  set_grammar  rows of the constraint tables written in place (a new automaton) -> state
  save_states, load_states  rows' recurrent states into snapshots and back (a hybrid
            cache's prefix caching) -> state
  prefill   the next block of parked rows' prompts -> (state, window readback)
  advance   rounds until every row finishes or a step count -> (state, readback)
  chunk     exactly a static number of rounds, no host read -> (state, window readback)
  evict     rows freed -> state

A window readback (`jspec.loop.state.readback_window`) holds each row's counters and only
the buffer positions the call wrote: after a chunk, the tokens it emitted (and their
logprobs); after a prompt pass, the first token, or with `Plan.prompt_logprobs` the
block's positions. Its size does not grow with the context.

`generate`, `Compiled.run` and `stream` are clients of these; a serving engine calls
`set_pages`, `set_grammar`, `admit`, `admit_cached`, `prefill`, `save_states`, `load_states`,
`chunk` and `evict` between chunks. The state is donated to the calls that take one, so each updates
it in place.
"""
from __future__ import annotations

import contextlib
import functools
import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from jspec.kernels import dispatch
from jspec.cache.layout import set_pages
from jspec.constraints.tables import write_rows
from jspec.loop.plan import Plan
from jspec.loop.round import advance, advance_rounds
from jspec.loop.rows import admit, admit_cached, evict, prefill, prefill_rest
from jspec.loop.state import Admission, LoopState, init_state, readback, readback_window


def start(plan: Plan, tw, pw, rows, adm: Admission) -> LoopState:
    """A fresh state with the requests admitted into `rows` and their prompts prefilled
    (in blocks of `plan.prefill_chunk`, where it is set)."""
    st = admit(plan, tw, pw, init_state(plan), rows, adm)
    return prefill_rest(plan, tw, pw, st, rows) if plan.prefill_chunk else st


def run(plan: Plan, tw, pw, rows, adm: Admission) -> LoopState:
    """`start`, then rounds until every row finishes (or plan.max_rounds rounds) -> the
    final state."""
    return advance(plan, tw, pw, start(plan, tw, pw, rows, adm), plan.max_rounds)


def generate_fn(plan: Plan, tw, pw, rows, adm: Admission) -> dict:
    return readback(run(plan, tw, pw, rows, adm))


def start_fn(plan: Plan, tw, pw, rows, adm: Admission):
    st = start(plan, tw, pw, rows, adm)
    return st, readback(st)


def pass_readback(plan: Plan, st: LoopState, rows, start) -> dict:
    """The window readback of a prompt pass over rows [A] from slot start [A]: each row's
    first token (position prompt_len), or with prompt logprobs the pass's block of
    positions start+1 .. start+C (the first token among them where the prompt ends)."""
    if plan.prompt_logprobs:
        token_start = st.request.prompt_len.at[rows].set(start + 1, mode="drop")
        return readback_window(st, token_start, st.rounds, plan.prefill_chunk or plan.prompt_len, 0)
    return readback_window(st, st.request.prompt_len, st.rounds, 1, 0)


def admit_fn(plan: Plan, tw, pw, st: LoopState, rows, adm: Admission, stop=None):
    st = admit(plan, tw, pw, st, rows, adm, stop)
    return st, pass_readback(plan, st, rows, jnp.zeros_like(rows))


def advance_fn(plan: Plan, tw, pw, st: LoopState, until):
    st = advance(plan, tw, pw, st, until)
    return st, readback(st)


def prefill_fn(plan: Plan, tw, pw, st: LoopState, rows, start, stop=None):
    st = prefill(plan, tw, pw, st, rows, start, stop)
    return st, pass_readback(plan, st, rows, start)


def chunk_fn(plan: Plan, tw, pw, st: LoopState, rounds: int):
    token_start, round_start = st.request.prompt_len + st.generated, st.rounds
    st = advance_rounds(plan, tw, pw, st, rounds)
    return st, readback_window(st, token_start, round_start, rounds * plan.max_emit, rounds)


def admit_cached_fn(plan: Plan, tw, pw, st: LoopState, rows, adm: Admission) -> LoopState:
    return admit_cached(plan, tw, pw, st, rows, adm)


def set_pages_fn(plan: Plan, tw, pw, st: LoopState, rows, cols, pages) -> LoopState:
    return st.replace(pages=set_pages(st.pages, rows, cols, pages))  # reads no weights


def set_grammar_fn(plan: Plan, tw, pw, st: LoopState, rows) -> LoopState:
    """Rows of the constraint tables written in place (`constraints.tables.write_rows`)."""
    return st.replace(grammar=st.grammar.replace(tables=write_rows(st.grammar.tables, rows)))  # reads no weights


def save_states_fn(plan: Plan, tw, pw, st: LoopState, rows, slots) -> LoopState:
    return st.replace(tcache=plan.family.cache_kind(plan.target).save_states(st.tcache, rows, slots))


def load_states_fn(plan: Plan, tw, pw, st: LoopState, rows, slots) -> LoopState:
    return st.replace(tcache=plan.family.cache_kind(plan.target).load_states(st.tcache, rows, slots))


def evict_fn(plan: Plan, tw, pw, st: LoopState, rows) -> LoopState:
    return evict(plan, st, rows)  # every entry point takes the weights; this one reads none


generate_jit = jax.jit(generate_fn, static_argnums=0)
start_jit = jax.jit(start_fn, static_argnums=0)
admit_jit = jax.jit(admit_fn, static_argnums=0, donate_argnums=3)
advance_jit = jax.jit(advance_fn, static_argnums=0, donate_argnums=3)
prefill_jit = jax.jit(prefill_fn, static_argnums=0, donate_argnums=3)
admit_cached_jit = jax.jit(admit_cached_fn, static_argnums=0, donate_argnums=3)
set_pages_jit = jax.jit(set_pages_fn, static_argnums=0, donate_argnums=3)
set_grammar_jit = jax.jit(set_grammar_fn, static_argnums=0, donate_argnums=3)
save_states_jit = jax.jit(save_states_fn, static_argnums=0, donate_argnums=3)
load_states_jit = jax.jit(load_states_fn, static_argnums=0, donate_argnums=3)

evict_jit = jax.jit(evict_fn, static_argnums=0, donate_argnums=3)
init_jit = jax.jit(init_state, static_argnums=0)


@functools.cache
def chunk_jit(rounds: int):
    """`chunk_fn` of `rounds` rounds, jitted (one entry point per count)."""
    return jax.jit(functools.partial(chunk_fn, rounds=rounds), static_argnums=0, donate_argnums=3)



# ----------------------------------------------------------------------------- compiled programs

_COMPILED: dict = {}  # (entry, plan, shapes, kernel backend, mesh, options) -> compiled program


def shapes_of(tree) -> tuple:
    """The structure, shapes and dtypes of a pytree of arrays: part of a program's key."""
    return jax.tree.structure(tree), tuple((np.shape(a), np.dtype(a.dtype)) for a in jax.tree.leaves(tree))


def xla_options(plan: Plan) -> dict:
    """The XLA options a plan's programs are compiled with (`Tuning.compiler_options`)."""
    return plan.tuning.compiler_options(plan.family.gpu_xla_options(plan.target))


def under(mesh):
    """The context to trace and run a program in: under `mesh`, if the weights are split."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def compiled(entry, plan: Plan, weights, args, mesh=None) -> tuple:
    """Entry point `entry` (one of this module's jitted functions taking the plan, then
    the weights (tw, pw), then `args`) compiled for `plan` and arguments of these shapes,
    once per equal key -> (the compiled program, seconds spent compiling now)."""
    options = xla_options(plan)
    key = (entry, plan, shapes_of(weights), shapes_of(args), dispatch.backend(), mesh,
           tuple(sorted(options.items())))
    if key in _COMPILED:
        return _COMPILED[key], 0.0
    t0 = time.perf_counter()
    with under(mesh):
        try:
            _COMPILED[key] = entry.lower(plan, *weights, *args).compile(options or None)
        except Exception as err:  # name the program: a kernel's failure to compile names none
            name = getattr(entry, "__name__", None) or getattr(getattr(entry, "__wrapped__", None), "__name__", entry)
            err.add_note(f"jspec: while compiling {name} for batch {plan.batch}, N={plan.N}, prefill_chunk="
                         f"{plan.prefill_chunk}, arguments {shapes_of(args)}")
            raise
    return _COMPILED[key], time.perf_counter() - t0


def twin(program):
    """A second loaded copy of a compiled program, deserialized from it (no compile), or
    None where the program cannot be serialized. On a GPU each copy keeps its own CUDA
    graphs: an engine that alternates two copies of its chunk program finds each copy's
    output buffers where that copy left them, so XLA does not update the graphs before
    every chunk (`jspec.serve.runner.Runner.chunk`)."""
    from jax.experimental.serialize_executable import deserialize_and_load, serialize
    try:
        payload, in_tree, out_tree = serialize(program)
    except (ValueError, NotImplementedError):  # a program that closes over constants, say
        return None
    devices = program.runtime_executable().local_devices()
    return deserialize_and_load(payload, in_tree, out_tree, execution_devices=devices)


def twins(items, threads: int | None = None) -> list:
    """`twin` of each compiled program of `items`, `threads` at a time (None:
    `compile_threads()`; loading one is mostly outside Python's lock: about 1 s for the 8B
    chunk program on an H200)."""
    items = list(items)
    threads = compile_threads() if threads is None else threads
    if threads > 1 and len(items) > 1:
        with ThreadPoolExecutor(min(threads, len(items)), thread_name_prefix="jspec-twin") as pool:
            return list(pool.map(twin, items))
    return [twin(p) for p in items]


def compile_threads() -> int:
    """Threads `compile_many` uses by default: the machine's cores, at most 8 (XLA's
    backend compile, most of a program's, releases Python's lock; tracing and lowering
    hold it)."""
    return max(1, min(8, os.cpu_count() or 1))


def compile_many(items, weights, mesh=None, threads: int | None = None) -> list[tuple]:
    """`compiled` for each (entry, plan, args) of `items`, `threads` at a time (None:
    `compile_threads()`) -> [(program, seconds spent compiling it now)] in their order.
    Items of one key compile once (the later ones cost 0 s)."""
    items = list(items)
    first_of: dict = {}  # key -> the first item of it
    for i, (entry, plan, args) in enumerate(items):
        first_of.setdefault((entry, plan, shapes_of(args)), i)
    firsts = list(first_of.values())
    one = lambda i: compiled(*items[i][:2], weights, items[i][2], mesh)
    threads = compile_threads() if threads is None else threads
    if threads > 1 and len(firsts) > 1:
        with ThreadPoolExecutor(min(threads, len(firsts)), thread_name_prefix="jspec-compile") as pool:
            done = dict(zip(firsts, pool.map(one, firsts)))
    else:
        done = {i: one(i) for i in firsts}
    return [done[i] if i in done else compiled(*items[i][:2], weights, items[i][2], mesh) for i in range(len(items))]


def compiled_count() -> int:
    """How many compiled programs are kept (one per entry point, plan and shapes)."""
    return len(_COMPILED)


def forget_compiled() -> None:
    _COMPILED.clear()
