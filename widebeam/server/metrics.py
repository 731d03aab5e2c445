"""Prometheus metrics of one server, in their own registry (nothing global is touched).

Gauges that describe the engine (requests running and waiting, KV blocks per pool) are read from a
snapshot the engine loop takes after every step, so `/metrics` never touches the engine itself.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector:
    """Reads the engine loop's latest `engine.stats()` snapshot."""

    def __init__(self, snapshot: Callable[[], dict]):
        self._snapshot = snapshot

    def collect(self):
        stats = self._snapshot()
        running = GaugeMetricFamily("widebeam_requests_running",
                                    "Engine requests running (holding KV blocks)")
        running.add_metric([], stats.get("running", 0))
        waiting = GaugeMetricFamily("widebeam_requests_waiting",
                                    "Engine requests admitted and waiting for blocks")
        waiting.add_metric([], stats.get("waiting", 0))
        rejected = CounterMetricFamily("widebeam_requests_rejected",
                                       "Engine requests rejected at admission (infeasible or invalid)")
        rejected.add_metric([], stats.get("rejected", 0))
        total = GaugeMetricFamily("widebeam_kv_blocks_total", "KV blocks in the pool", labels=["pool"])
        free = GaugeMetricFamily("widebeam_kv_blocks_free",
                                 "KV blocks not in use in the pool (free, or cached "
                                 "prompt blocks no request holds, evicted when needed)", labels=["pool"])
        evictable = GaugeMetricFamily("widebeam_kv_blocks_evictable", "Cached prompt blocks no request holds "
                                      "(counted in free)", labels=["pool"])
        pinned = GaugeMetricFamily("widebeam_kv_blocks_pinned", "Blocks of pinned prefixes (never evicted, "
                                   "off the pool's capacity)", labels=["pool"])
        # every worker's pools: "self", "draft/sliding_512"
        for pool, s in sorted(stats.get("pools", {}).items()):
            total.add_metric([pool], s["total_blocks"])
            free.add_metric([pool], s["free_blocks"])
            evictable.add_metric([pool], s.get("evictable_blocks", 0))
            pinned.add_metric([pool], s.get("pinned_blocks", 0))
        refused = CounterMetricFamily("widebeam_requests_queue_full",
                                      "Requests refused with 429: the waiting queue at its bound")
        refused.add_metric([], stats.get("queue", {}).get("refused", 0))
        by_priority = GaugeMetricFamily("widebeam_requests_waiting_by_priority",
                                        "Engine requests waiting, by their priority (lower runs first)",
                                        labels=["priority"])
        for priority, count in stats.get("queue", {}).get("waiting_by_priority", {}).items():
            by_priority.add_metric([str(priority)], count)
        yield from (running, waiting, by_priority, rejected, refused, total, free, evictable, pinned)
        if "prefix_cache" in stats:
            yield from _prefix_cache_metrics(stats["prefix_cache"])
        if "speculative" in stats:
            yield from _speculative_metrics(stats["speculative"])
        if "scheduling" in stats:
            yield from _scheduling_metrics(stats["scheduling"])


def _scheduling_metrics(scheduling: dict):
    """The capacity policy (`--scheduling-policy`) and its preemptions, labelled by the policy:
    requests preempted (blocks taken back, resumed by recomputation), and the tokens they computed
    again (prompt and generated tokens whose K/V were dropped, less those the prefix cache still held)."""
    labels, values = ["policy"], [scheduling["policy"]]
    policy = GaugeMetricFamily("widebeam_scheduling_policy", "The engine's capacity scheduling policy (1)",
                               labels=labels)
    policy.add_metric(values, 1)
    preemptions = CounterMetricFamily("widebeam_scheduling_preemptions", "Requests preempted (resumed by "
                                      "recomputation, outputs unchanged)", labels=labels)
    preemptions.add_metric(values, scheduling["preemptions"])
    recomputed = CounterMetricFamily("widebeam_scheduling_recomputed_tokens", "Tokens computed again by "
                                     "preempted requests (prefix-cache hits excepted)", labels=labels)
    recomputed.add_metric(values, scheduling["recomputed_tokens"])
    yield from (policy, preemptions, recomputed)


def _prefix_cache_metrics(prefix: dict):
    """Prefix reuse in tokens: the prompt (and encoder input) tokens admitted requests looked up,
    and those found cached; the hit rate is their ratio."""
    queried = CounterMetricFamily("widebeam_prefix_cache_queried_tokens",
                                  "Prompt tokens of admitted requests looked up in the prefix cache")
    queried.add_metric([], prefix["queried_tokens"])
    hits = CounterMetricFamily("widebeam_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache "
                               "(not computed)")
    hits.add_metric([], prefix["hit_tokens"])
    rate = GaugeMetricFamily("widebeam_prefix_cache_hit_rate", "Hit tokens / queried tokens since start")
    rate.add_metric([], prefix["hit_rate"])
    yield from (queried, hits, rate)


def _speculative_metrics(spec: dict):
    """Speculative decoding's counters (only when the engine speculates), labelled by its method.
    The acceptance rate is accepted / drafted; tokens per round, (accepted + rounds) / rounds."""
    labels, values = ["method"], [spec["method"]]
    tokens = GaugeMetricFamily("widebeam_speculative_num_tokens",
                               "Tokens drafted per sequence and round (D, --num-speculative-tokens)",
                               labels=labels)
    tokens.add_metric(values, spec["num_speculative_tokens"])
    rounds = CounterMetricFamily("widebeam_speculative_rounds", "Speculative rounds run (draft, then one "
                                 "verifying target pass)", labels=labels)
    rounds.add_metric(values, spec["rounds"])
    drafted = CounterMetricFamily("widebeam_speculative_drafted_tokens", "Tokens the draft proposed",
                                  labels=labels)
    drafted.add_metric(values, spec["drafted_tokens"])
    accepted = CounterMetricFamily("widebeam_speculative_accepted_tokens",
                                   "Drafted tokens the target accepted", labels=labels)
    accepted.add_metric(values, spec["accepted_tokens"])
    yield from (tokens, rounds, drafted, accepted)


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], dict]):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(snapshot))
        r = self.registry
        self.finished = Counter("widebeam_requests_finished", "Engine requests finished, by finish reason "
                                "(of the best choice)", ["finish_reason"], registry=r)
        self.aborted = Counter("widebeam_requests_aborted",
                               "Engine requests aborted (client gone, or shutdown)", registry=r)
        self.failed = Counter("widebeam_requests_failed",
                              "Engine requests that failed with a server error (their "
                              "own processing, or the shared step)", registry=r)
        self.prompt_tokens = Counter("widebeam_prompt_tokens", "Prompt tokens of admitted requests",
                                     registry=r)
        self.generated_tokens = Counter("widebeam_generation_tokens",
                                        "Tokens generated (for beam search: of the returned beams)",
                                        registry=r)
        self.time_to_first_token = Histogram("widebeam_time_to_first_token_seconds",
                                             "From arrival to the step that chose the first token",
                                             buckets=_LATENCY_BUCKETS, registry=r)
        self.time_per_output_token = Histogram("widebeam_time_per_output_token_seconds",
                                               "Mean time per generated token after the first, per request",
                                               buckets=_LATENCY_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
