"""Compiled constraints on the device: one set of tables for every automaton a batch
holds (`GrammarTables`), and the lookups a round makes in them.

States are numbered globally: state 0 is FREE (every token allowed, never left), the
unconstrained rows' state; each automaton's states follow at an offset of its own. For
state q:

- allowed[q]: a bitmask of the tokens q may emit (bit t % 32 of word t // 32);
- next(q, t) = the exception's next state where t is among q's exceptions (sorted token
  ids, exc_tokens[exc_start[q]:exc_end[q]]), else default[q]: most of a state's tokens lead to
  one state (inside a JSON string, nearly every token leads back there), so the table
  keeps only the others: the 335,687 transitions of `Json()` over the bundled tokenizer's
  4,096 tokens keep 10,672 exceptions;
- terminal[q]: the constraint is complete at q (a request that reaches it ends).

A token q does not allow leads anywhere (its node is never accepted: the choice at its
parent was masked with the parent's state). Shapes are static (capacities Q and E, powers
of two): new constraints never recompile a program that has room for them.
"""
from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.constraints.automaton import Automaton

FREE = 0


@struct.dataclass
class GrammarTables:
    allowed: jax.Array  # [Q, W] uint32, W = ceil(V / 32)
    default: jax.Array  # [Q] int32
    exc_start: jax.Array  # [Q] int32: state q's exceptions are [exc_start[q], exc_end[q])
    exc_end: jax.Array  # [Q] int32 (its own bound: automata placed anywhere never share one)
    exc_tokens: jax.Array  # [E] int32, sorted within each state
    exc_next: jax.Array  # [E] int32
    terminal: jax.Array  # [Q] bool


def pow2(n: int, lo: int) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


@functools.lru_cache(maxsize=64)
def exceptions(automaton: Automaton) -> list[tuple[int, dict]]:
    """Per state: (its default next state, {token: next} of the tokens that go elsewhere)."""
    out = []
    for tr in automaton.transitions:
        default = collections.Counter(tr.values()).most_common(1)[0][0] if tr else 0
        out.append((default, {t: n for t, n in tr.items() if n != default}))
    return out


def capacity(automata) -> tuple[int, int]:
    """(Q, E): the states (FREE included) and exceptions these automata need, as powers of
    two (at least 16 and 64)."""
    distinct = {a.key: a for a in automata}.values()
    states = 1 + sum(needs(a)[0] for a in distinct)
    edges = sum(needs(a)[1] for a in distinct)
    return pow2(states, 16), pow2(edges, 64)


def empty(Q: int, E: int, V: int) -> GrammarTables:
    """Host tables (numpy) holding FREE alone."""
    W = -(-V // 32)
    full = np.zeros(W * 32, bool)
    full[:V] = True
    allowed = np.zeros((Q, W), np.uint32)
    allowed[FREE] = bitmask(full, W)
    return GrammarTables(allowed=allowed, default=np.zeros(Q, np.int32), exc_start=np.zeros(Q, np.int32),
                         exc_end=np.zeros(Q, np.int32),
                         exc_tokens=np.full(E, np.iinfo(np.int32).max, np.int32), exc_next=np.zeros(E, np.int32),
                         terminal=np.zeros(Q, bool))


def needs(automaton: Automaton) -> tuple[int, int]:
    """(states, exceptions) an automaton takes in the tables."""
    return automaton.num_states, sum(len(exc) for _, exc in exceptions(automaton))


def write(host: GrammarTables, automaton: Automaton, q0: int, e0: int) -> None:
    """Writes `automaton` into host tables (numpy, in place): its states from q0, its
    exceptions from e0 (each state's in token order)."""
    V = host.allowed.shape[1] * 32
    e = e0
    for local, (tr, (dflt, exc)) in enumerate(zip(automaton.transitions, exceptions(automaton))):
        q = q0 + local
        bits = np.zeros(V, bool)
        bits[[t for t in tr if t < V]] = True
        host.allowed[q] = bitmask(bits, host.allowed.shape[1])
        host.default[q] = q0 + dflt
        host.exc_start[q] = e
        for t in sorted(exc):
            host.exc_tokens[e], host.exc_next[e] = t, q0 + exc[t]
            e += 1
        host.exc_end[q] = e
        host.terminal[q] = automaton.terminal[local]


def pack(automata, Q: int, E: int, V: int) -> tuple[GrammarTables, dict]:
    """Host tables (numpy) of `automata` in capacities Q, E over a vocabulary of V, one
    after another -> (tables, {automaton key: its state offset}); ValueError if they do
    not fit."""
    need = capacity(automata)
    if need[0] > Q or need[1] > E:
        raise ValueError(f"these constraints need {need[0]} states and {need[1]} transitions of the tables; "
                         f"the program holds {Q} and {E}: compile with them instead")
    host = empty(Q, E, V)
    offsets, q, e = {}, 1, 0
    for a in automata:
        if a.key in offsets:
            continue
        offsets[a.key] = q
        write(host, a, q, e)
        states, exc = needs(a)
        q, e = q + states, e + exc
    return host, offsets


def bitmask(bits: np.ndarray, W: int) -> np.ndarray:
    """bool [W * 32] -> uint32 [W], token t at bit t % 32 of word t // 32."""
    return (bits.reshape(W, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(axis=1).astype(np.uint32)


@struct.dataclass
class TableRows:
    """Some states' rows and some exceptions of the tables, to write in place
    (`write_rows`): U states and X exceptions, indices past the tables (Q, E) for none."""

    states: jax.Array  # [U] int32
    allowed: jax.Array  # [U, W] uint32
    default: jax.Array  # [U] int32
    terminal: jax.Array  # [U] bool
    exc_start: jax.Array  # [U] int32
    exc_end: jax.Array  # [U] int32
    exc_at: jax.Array  # [X] int32
    exc_tokens: jax.Array  # [X] int32
    exc_next: jax.Array  # [X] int32


def rows_of(host: GrammarTables, q0: int, n: int, e0: int, m: int, U: int, X: int) -> list[TableRows]:
    """The host tables' states [q0, q0 + n) and exceptions [e0, e0 + m) as `TableRows` of
    U states and X exceptions each (numpy)."""
    Q, E = host.default.shape[0], host.exc_tokens.shape[0]
    out = []
    for k in range(max(-(-n // U), -(-m // X), 1)):
        qs = np.arange(q0 + k * U, q0 + (k + 1) * U)
        live = qs < q0 + n
        rows = np.where(live, qs, Q)
        es = np.arange(e0 + k * X, e0 + (k + 1) * X)
        elive = es < e0 + m
        pick = np.minimum(qs, Q - 1)
        epick = np.minimum(es, E - 1)
        out.append(TableRows(states=rows.astype(np.int32), allowed=host.allowed[pick] * live[:, None],
                             default=host.default[pick], terminal=host.terminal[pick] & live,
                             exc_start=host.exc_start[pick], exc_end=host.exc_end[pick],
                             exc_at=np.where(elive, es, E).astype(np.int32), exc_tokens=host.exc_tokens[epick],
                             exc_next=host.exc_next[epick]))
    return out


def write_rows(tables: GrammarTables, rows: TableRows) -> GrammarTables:
    """`rows` written into the device's tables (entries past them dropped)."""
    return tables.replace(
        allowed=tables.allowed.at[rows.states].set(rows.allowed, mode="drop"),
        default=tables.default.at[rows.states].set(rows.default, mode="drop"),
        terminal=tables.terminal.at[rows.states].set(rows.terminal, mode="drop"),
        exc_start=tables.exc_start.at[rows.states].set(rows.exc_start, mode="drop"),
        exc_end=tables.exc_end.at[rows.states].set(rows.exc_end, mode="drop"),
        exc_tokens=tables.exc_tokens.at[rows.exc_at].set(rows.exc_tokens, mode="drop"),
        exc_next=tables.exc_next.at[rows.exc_at].set(rows.exc_next, mode="drop"))


def free_tables(Q: int, E: int, V: int) -> GrammarTables:
    """Tables holding FREE alone (device arrays, built from small pieces: traced inside a
    program they add no large constant to it)."""
    W = -(-V // 32)
    free_row = jnp.asarray(empty(1, 1, V).allowed[0])  # [W]
    return GrammarTables(allowed=jnp.zeros((Q, W), jnp.uint32).at[FREE].set(free_row),
                         default=jnp.zeros((Q,), jnp.int32), exc_start=jnp.zeros((Q,), jnp.int32),
                         exc_end=jnp.zeros((Q,), jnp.int32),
                         exc_tokens=jnp.full((E,), np.iinfo(np.int32).max, jnp.int32),
                         exc_next=jnp.zeros((E,), jnp.int32), terminal=jnp.zeros((Q,), bool))


# ----------------------------------------------------------------------------- on the device

def next_state(tables: GrammarTables, q, t):
    """The state after state q emits token t (int32 arrays that broadcast). A lower-bound
    search unrolled over the exceptions' capacity, in few operations: the programs make
    this lookup once a draft step and tree level, and its size is most of theirs."""
    E = tables.exc_tokens.shape[0]
    q, t = jnp.broadcast_arrays(q, t)
    lo, hi = tables.exc_start[q], tables.exc_end[q]  # lo <= hi throughout; lo == hi: found
    end = hi
    most = min(E, 32 * tables.allowed.shape[1])  # a state's exceptions: at most one a token
    for _ in range(max(most, 2).bit_length()):  # the first exception >= t
        mid = jax.lax.shift_right_logical(lo + hi, 1)  # mid == lo == hi once they meet
        right = (lo < hi) & (jnp.take(tables.exc_tokens, mid, mode="clip") < t)
        lo, hi = jax.lax.select(right, mid + 1, lo), jax.lax.select(right, hi, mid)
    found = (lo < end) & (jnp.take(tables.exc_tokens, lo, mode="clip") == t)
    return jax.lax.select(found, jnp.take(tables.exc_next, lo, mode="clip"), tables.default[q]).astype(jnp.int32)


def allowed_mask(tables: GrammarTables, q, V: int):
    """q [...] -> bool [..., V]: the tokens state q allows."""
    words = tables.allowed[q]  # [..., W]
    bits = (words[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
    return bits.reshape(q.shape + (-1,))[..., :V].astype(bool)


def mask_logits(tables: GrammarTables, q, logits):
    """logits [..., V] with the tokens state q [...] does not allow at -inf."""
    return jnp.where(allowed_mask(tables, q, logits.shape[-1]), logits, -jnp.inf)


def node_states(tables: GrammarTables, row_state, tokens, parents, depth, max_depth: int):
    """Each node's state [B, N]: the root's is its row's (the state after the committed
    tokens), a node's the state after its parent's emits its token (a chain or tree of
    at most `max_depth` levels below the root)."""
    q = jnp.broadcast_to(row_state[:, None], tokens.shape)
    for d in range(1, max_depth + 1):
        parent_q = jnp.take_along_axis(q, jnp.maximum(parents, 0), axis=1)
        q = jnp.where(depth == d, next_state(tables, parent_q, tokens), q)
    return q
