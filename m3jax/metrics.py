"""The server's metrics in Prometheus' text format (``GET /metrics`` of ``m3jax serve``), no dependency.

``ServerMetrics`` is one server's counters and histograms (thread-safe; one per ``m3jax.serving.Server``, no
global state). ``render`` adds the engine's live gauges, read from ``engine.serving_stats()`` when the engine has
it (a mapping; every key optional, missing ones count as described below):

  waiting, running            requests queued / being decoded (default: 0)
  cache_slots_used, cache_slots_total      sequence slots holding a request / all slots
  cache_pages_used, cache_pages_total      KV-cache pages in use / in the pool (a paged engine; omitted if absent)
  prefix_cache_queries, prefix_cache_hits  prompt tokens looked up in the prefix cache / found there (a paged
                              engine with prefix caching; the hit rate is hits / queries, 0 while there are none)
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Mapping, Sequence
from typing import Any

# Histogram bucket upper bounds (seconds): time to first token spans a short prompt on a GPU to a long prefill on
# CPU; time per output token a fast decode step to a slow one.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
PREFIX = "m3jax"


class Histogram:
  """A Prometheus histogram: cumulative bucket counts, sum and count."""

  def __init__(self, bounds: Sequence[float]):
    self.bounds = tuple(bounds)
    self.counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound (+Inf only)
    self.sum = 0.0
    self.count = 0

  def observe(self, value: float) -> None:
    self.counts[bisect.bisect_left(self.bounds, value)] += 1
    self.sum += value
    self.count += 1

  def lines(self, name: str) -> list[str]:
    out, total = [], 0
    for bound, n in zip(self.bounds, self.counts):
      total += n
      out.append(f'{name}_bucket{{le="{bound}"}} {total}')
    out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
    out += [f"{name}_sum {self.sum}", f"{name}_count {self.count}"]
    return out


class ServerMetrics:
  """Counters of the requests a server answered and the tokens it read and wrote, and latency histograms."""

  def __init__(self):
    self._lock = threading.Lock()
    self.requests: dict[tuple[str, int], int] = {}  # (path, HTTP status) -> requests answered
    self.prompt_tokens = 0
    self.generation_tokens = 0
    self.ttft = Histogram(TTFT_BUCKETS)
    self.tpot = Histogram(TPOT_BUCKETS)
    self.latency = Histogram(LATENCY_BUCKETS)

  def request_done(self, path: str, status: int, seconds: float, prompt_tokens: int = 0,
                   completion_tokens: int = 0) -> None:
    """One answered request (any route, any status)."""
    with self._lock:
      key = (path, int(status))
      self.requests[key] = self.requests.get(key, 0) + 1
      self.prompt_tokens += prompt_tokens
      self.generation_tokens += completion_tokens
      self.latency.observe(seconds)

  def first_token(self, seconds: float) -> None:
    """A completion's first generated token came ``seconds`` after its request arrived."""
    with self._lock:
      self.ttft.observe(seconds)

  def per_output_token(self, seconds: float) -> None:
    """A completion's mean time between generated tokens after the first."""
    with self._lock:
      self.tpot.observe(seconds)

  def render(self, engine_stats: Mapping[str, Any] | None = None) -> str:
    """Everything in Prometheus' text exposition format (version 0.0.4)."""
    stats = dict(engine_stats or {})
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[str]) -> None:
      lines.extend([f"# HELP {PREFIX}_{name} {help_text}", f"# TYPE {PREFIX}_{name} {kind}"] + samples)

    with self._lock:
      metric("requests_total", "counter", "HTTP requests answered, by route and status.",
             [f'{PREFIX}_requests_total{{path="{p}",status="{s}"}} {n}' for (p, s), n in sorted(self.requests.items())])
      metric("prompt_tokens_total", "counter", "Prompt tokens of the completions served.",
             [f"{PREFIX}_prompt_tokens_total {self.prompt_tokens}"])
      metric("generation_tokens_total", "counter", "Tokens generated.",
             [f"{PREFIX}_generation_tokens_total {self.generation_tokens}"])
      metric("time_to_first_token_seconds", "histogram", "Seconds from a request's arrival to its first token.",
             self.ttft.lines(f"{PREFIX}_time_to_first_token_seconds"))
      metric("time_per_output_token_seconds", "histogram", "Mean seconds between a completion's tokens after "
             "the first.", self.tpot.lines(f"{PREFIX}_time_per_output_token_seconds"))
      metric("request_latency_seconds", "histogram", "Seconds from a request's arrival to its last byte.",
             self.latency.lines(f"{PREFIX}_request_latency_seconds"))
    metric("requests_waiting", "gauge", "Requests queued for a free slot.",
           [f"{PREFIX}_requests_waiting {int(stats.get('waiting', 0))}"])
    metric("requests_running", "gauge", "Requests being decoded.",
           [f"{PREFIX}_requests_running {int(stats.get('running', 0))}"])
    for unit in ("slots", "pages"):
      if f"cache_{unit}_used" in stats:
        metric(f"cache_{unit}_used", "gauge", f"KV-cache {unit} holding a request.",
               [f"{PREFIX}_cache_{unit}_used {int(stats[f'cache_{unit}_used'])}"])
      if f"cache_{unit}_total" in stats:
        metric(f"cache_{unit}_total", "gauge", f"KV-cache {unit} in all.",
               [f"{PREFIX}_cache_{unit}_total {int(stats[f'cache_{unit}_total'])}"])
    queries, hits = int(stats.get("prefix_cache_queries", 0)), int(stats.get("prefix_cache_hits", 0))
    metric("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
           [f"{PREFIX}_prefix_cache_queries_total {queries}"])
    metric("prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
           [f"{PREFIX}_prefix_cache_hits_total {hits}"])
    metric("prefix_cache_hit_rate", "gauge", "Prefix-cache hits / queries (0 while there are none).",
           [f"{PREFIX}_prefix_cache_hit_rate {hits / queries if queries else 0.0}"])
    return "\n".join(lines) + "\n"
