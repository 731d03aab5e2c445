"""One `/metrics` for replicas behind the router: each replica's samples labelled `replica="<id>"`, their
sum under `replica="all"` (counters, gauges and histogram buckets all add up across replicas), and the
router's own gauges. Parsed and written back with prometheus_client, so the text is the format a
scraper expects."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

ALL_REPLICAS = "all"


class _Merged:
    def __init__(self, by_replica: Mapping[str, str], router: Mapping[str, float]):
        self.by_replica = by_replica
        self.router = router

    def collect(self):
        families: dict[str, Metric] = {}
        sums: dict[str, dict[tuple, float]] = {}
        for replica_id, text in sorted(self.by_replica.items()):
            for family in text_string_to_metric_families(text):
                merged = families.setdefault(family.name,
                                             Metric(family.name, family.documentation, family.type))
                totals = sums.setdefault(family.name, {})
                for sample in family.samples:
                    merged.add_sample(sample.name, {**sample.labels, "replica": replica_id}, sample.value)
                    if sample.name.endswith("_created"):  # a start time: no sum
                        continue
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    totals[key] = totals.get(key, 0.0) + sample.value
        for name, merged in families.items():
            for (sample_name, labels), value in sums[name].items():
                merged.add_sample(sample_name, {**dict(labels), "replica": ALL_REPLICAS}, value)
            yield merged
        for name, value in sorted(self.router.items()):
            gauge = GaugeMetricFamily(name, "The exact-fit router (server/router_ingress.py)")
            gauge.add_metric([], value)
            yield gauge


def merge_replica_metrics(by_replica: Mapping[str, str], router: Mapping[str, float]) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(by_replica, router))
    return generate_latest(registry).decode()
