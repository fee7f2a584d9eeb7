"""What a serving engine counts (`Engine.stats`): plain numbers and histograms, kept on
the host as requests and chunks go; the server exports them as Prometheus metrics under
vLLM's names with the `jspec:` prefix (`jspec.serve.server`)."""
from __future__ import annotations

import bisect
import dataclasses
import threading

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # seconds


class Histogram:
    """Observations counted into buckets with upper bounds `bounds` (and +Inf)."""

    def __init__(self, bounds):
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times
        self.count += times

    def cumulative(self) -> list[tuple[str, int]]:
        """(upper bound as Prometheus writes it, observations <= it), +Inf last."""
        out, total = [], 0
        for bound, n in zip([*(repr(b) for b in self.bounds), "+Inf"], self.counts):
            total += n
            out.append((bound, total))
        return out


@dataclasses.dataclass
class EngineStats:
    """Counters and histograms of an engine (updated under `lock`). tier_chunks: chunks run
    on each speculation tier, by name."""

    max_accept: int = 1
    admitted: int = 0
    finished: int = 0
    cancelled: int = 0
    chunks: int = 0
    rounds: int = 0
    prefill_passes: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec_draft_tokens: int = 0  # drafts verified (nodes besides the root) over speculating rows' rounds
    spec_accepted_tokens: int = 0  # of those, accepted
    accept_rounds: int = 0
    accept_tokens: int = 0
    startup_s: float = 0.0
    host_s: float = 0.0  # the driving thread's CPU time in `step` outside program calls and readbacks: its own work
    launch_s: float = 0.0  # its CPU time inside program calls (the dispatch; on a GPU, each kernel's launch)
    wait_s: float = 0.0  # its time waiting for readbacks
    longest_step_s: float = 0.0  # the longest iteration's wall time (a stall of the driving thread shows here)
    programs: int = 0  # programs compiled at start-up (`Engine.warm_up`)
    finish_reasons: dict = dataclasses.field(default_factory=dict)
    tier_chunks: dict = dataclasses.field(default_factory=dict)
    round_costs: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.lock = threading.Lock()
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.tpot = Histogram(LATENCY_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.queue_time = Histogram(LATENCY_BUCKETS)
        self.accept_length = Histogram(range(1, self.max_accept + 1))

    @property
    def mean_accept_length(self) -> float:
        return self.accept_tokens / self.accept_rounds if self.accept_rounds else 1.0
