"""A tether server's /metrics as the benchmarks read it: samples by name and labels, histograms
and their quantiles, and the gauges that must settle once load stops."""

from __future__ import annotations

import dataclasses
import math
import time
import urllib.request
from collections.abc import Sequence

from prometheus_client.parser import text_string_to_metric_families

# Gauges that must return to their idle value once load stops.
SETTLE_GAUGES = ("tether_requests_running", "tether_requests_waiting",
                 "tether_kv_cache_blocks_used", "tether_conversation_placeholders")

LabelSet = tuple[tuple[str, str], ...]


@dataclasses.dataclass(slots=True, frozen=True)
class Histogram:
    buckets: list[tuple[float, float]]  # (upper bound, cumulative count), sorted
    sum: float
    count: float

    def minus(self, before: Histogram) -> Histogram:
        old = dict(before.buckets)
        return Histogram([(le, c - old.get(le, 0.0)) for le, c in self.buckets],
                         self.sum - before.sum, self.count - before.count)

    def bucket(self, q: float) -> tuple[float, float] | None:
        """(lower, upper] bounds of the bucket holding the q-th observation: what is exact."""
        if self.count <= 0:
            return None
        lower = 0.0
        for le, cum in self.buckets:
            if cum >= q * self.count:
                return lower, le
            lower = le
        return lower, math.inf

    def quantile(self, q: float) -> float | None:
        """Linear interpolation inside the bucket holding the q-th observation."""
        if self.count <= 0:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for le, cum in self.buckets:
            if cum >= rank:
                if math.isinf(le):
                    return lower
                span = cum - below
                return lower + (le - lower) * ((rank - below) / span if span else 1.0)
            lower, below = le, cum
        return lower


@dataclasses.dataclass(slots=True, frozen=True)
class Metrics:
    samples: dict[tuple[str, LabelSet], float]

    def has(self, name: str) -> bool:
        return any(n == name for n, _ in self.samples)

    def get(self, name: str, **labels: str) -> float | None:
        return self.samples.get((name, tuple(sorted(labels.items()))))

    def total(self, name: str) -> float:
        """Sum over every label set; 0 when the series is absent."""
        return sum(v for (n, _), v in self.samples.items() if n == name)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for (n, labels), v in self.samples.items():
            if n == name:
                key = dict(labels).get(label, "")
                out[key] = out.get(key, 0.0) + v
        return out

    def histogram(self, name: str) -> Histogram | None:
        buckets = [(float(dict(labels)["le"]), v) for (n, labels), v in self.samples.items()
                   if n == name + "_bucket"]
        if not buckets:
            return None
        return Histogram(sorted(buckets), self.total(name + "_sum"), self.total(name + "_count"))


def parse_metrics(text: str) -> Metrics:
    samples: dict[tuple[str, LabelSet], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return Metrics(samples)


def scrape(base_url: str, timeout: float = 5.0) -> Metrics:
    with urllib.request.urlopen(base_url + "/metrics", timeout=timeout) as r:
        return parse_metrics(r.read().decode())


def gauges(m: Metrics, names: Sequence[str] = SETTLE_GAUGES) -> dict[str, float]:
    return {n: m.total(n) for n in names}


def wait_settled(base_url: str, baseline: dict[str, float], within: float,
                 poll: float = 0.05) -> tuple[bool, dict[str, float], float]:
    """Poll until every gauge is at (or below) its baseline.

    Returns (settled, last gauges, seconds waited).
    """
    start = time.monotonic()
    while True:
        now = gauges(scrape(base_url), list(baseline))
        waited = time.monotonic() - start
        if all(now[k] <= baseline[k] for k in baseline):
            return True, now, waited
        if waited >= within:
            return False, now, waited
        time.sleep(poll)
