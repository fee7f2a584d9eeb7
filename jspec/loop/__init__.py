"""The generation loop, all on device: a batch of request rows, admitted and evicted
between calls, and a `lax.while_loop` of speculative rounds.

  plan.py      Plan (the compile key) and make_plan
  state.py     the loop state: per-row requests, tokens, caches, proposer state
  round.py     a round's phases (propose, verify, accept, commit, observe) and `advance`
  rows.py      admit (prefill only the given rows) and evict
  accept.py    acceptance: greedy, target-only sampling, sampled drafts
  tree.py      draft trees as static-shape arrays
  budget.py    confidence-budgeted verification: how much of a chain a round verifies
  proposers/   the draft side of a round: neural (draft models), ngram (prompt lookup)
  programs.py  the jitted entry points
"""
