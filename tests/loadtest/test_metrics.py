"""The load-test helpers' reading of Prometheus histograms."""

import math

from loadtest.metrics import Histogram


def test_histogram_bucket_bounds_and_interpolated_quantile() -> None:
    # 10 observations: 6 in (0, 0.002], 3 in (0.002, 0.005], 1 in (0.005, 0.01].
    hist = Histogram([(0.002, 6), (0.005, 9), (0.01, 10), (math.inf, 10)], 0.03, 10)
    assert hist.bucket(0.5) == (0.0, 0.002)
    assert hist.bucket(0.9) == (0.002, 0.005)
    assert hist.bucket(0.99) == (0.005, 0.01)
    p99 = hist.quantile(0.99)
    assert p99 is not None and 0.005 < p99 <= 0.01
    empty = Histogram([(0.002, 0), (math.inf, 0)], 0.0, 0)
    assert empty.bucket(0.99) is None and empty.quantile(0.99) is None


def test_histogram_minus_isolates_one_phase() -> None:
    before = Histogram([(1.0, 2), (math.inf, 3)], 4.0, 3)
    after = Histogram([(1.0, 2), (math.inf, 5)], 9.0, 5)
    phase = after.minus(before)
    assert phase.count == 2 and phase.bucket(0.99) == (1.0, math.inf)
