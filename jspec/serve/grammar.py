"""The serving engine's constraint tables, kept on the host (`jspec.constraints.tables`):
which automata hold which states and exceptions of the device's tables.

An automaton is placed when a request that carries it is admitted: its states and its
exceptions each take a contiguous range (first fit), written into the host's copy, and
those rows go to the device's tables in place (`set_grammar`, a few calls of fixed size)
before the admission's call. Automata stay placed after their
requests finish (a schema asked again needs no write); when a new one does not fit, the
least recently used that no row holds are dropped. A row's state indexes the tables, so
an automaton a row holds never moves; a preempted request is placed again when it
resumes (its start state is recomputed from its output so far, `requests.pack`).
"""
from __future__ import annotations

import collections

from jspec.constraints import tables as gt
from jspec.constraints.automaton import Automaton


class Ranges:
    """Free ranges of [lo, hi) (first fit)."""

    def __init__(self, lo: int, hi: int):
        self.free = [(lo, hi)] if hi > lo else []

    def take(self, n: int) -> int | None:
        if n == 0:
            return self.free[0][0] if self.free else 0
        for i, (a, b) in enumerate(self.free):
            if b - a >= n:
                self.free[i:i + 1] = [(a + n, b)] if b - a > n else []
                return a
        return None

    def give(self, start: int, n: int) -> None:
        if n == 0:
            return
        self.free.append((start, start + n))
        self.free.sort()
        merged = []
        for a, b in self.free:
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            else:
                merged.append((a, b))
        self.free = merged


class ConstraintSlots:
    """Placement of automata in tables of Q states (state 0: FREE) and E exceptions over a
    vocabulary of V."""

    def __init__(self, Q: int, E: int, V: int):
        self.Q, self.E, self.V = Q, E, V
        self.host = gt.empty(Q, E, V)
        self.states, self.edges = Ranges(1, Q), Ranges(0, E)
        self.placed: collections.OrderedDict[str, tuple[int, int, int, int]] = collections.OrderedDict()
        self.written: list[tuple[int, int, int, int]] = []  # (q0, states, e0, exceptions) not yet on the device

    def check(self, automaton: Automaton) -> None:
        """ValueError if the automaton could never fit the tables."""
        states, exc = gt.needs(automaton)
        if states > self.Q - 1 or exc > self.E:
            raise ValueError(f"constraint: its automaton has {states} states and {exc} transitions outside their "
                             f"states' defaults; the engine's tables hold {self.Q - 1} and {self.E} "
                             f"(Engine(constraint_states=...))")

    def place(self, automata, held: set[str]) -> dict[str, int]:
        """Every automaton placed (those not yet: written into the host's copy, dropping
        the least recently used ones not in `held`, the keys rows hold) -> {key: state
        offset}. ValueError if they cannot all fit beside what rows hold."""
        for a in automata:
            if a.key in self.placed:
                self.placed.move_to_end(a.key)
                continue
            states, exc = gt.needs(a)
            while True:
                q0, e0 = self.states.take(states), self.edges.take(exc)
                if q0 is not None and e0 is not None:
                    break
                if q0 is not None:
                    self.states.give(q0, states)
                if e0 is not None:
                    self.edges.give(e0, exc)
                victim = next((k for k in self.placed if k not in held and k not in {b.key for b in automata}),
                              None)
                if victim is None:
                    raise ValueError("the engine's constraint tables are full with the constraints of running "
                                     "requests (Engine(constraint_states=...))")
                vq, vs, ve, vn = self.placed.pop(victim)
                self.states.give(vq, vs)
                self.edges.give(ve, vn)
            gt.write(self.host, a, q0, e0)
            self.placed[a.key] = (q0, states, e0, exc)
            self.written.append((q0, states, e0, exc))
        return {k: v[0] for k, v in self.placed.items()}

    def take_rows(self, U: int, X: int) -> list[gt.TableRows]:
        """The rows of the automata placed since the last call, as `TableRows` of U states
        and X exceptions (numpy) for the device."""
        out = [rows for q0, n, e0, m in self.written for rows in gt.rows_of(self.host, q0, n, e0, m, U, X)]
        self.written = []
        return out

    @property
    def nbytes(self) -> int:
        """The tables' bytes (the device holds the same)."""
        return sum(a.nbytes for a in (self.host.allowed, self.host.default, self.host.exc_start, self.host.exc_end,
                                      self.host.exc_tokens, self.host.exc_next, self.host.terminal))

