"""What a run leaves: summary figures, goal lines, and JSON and PNGs under results/."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadtest.pair import REPO

RESULTS = REPO / "results"


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summary(values: Sequence[float]) -> dict[str, float | int | None]:
    return {"n": len(values), "mean": sum(values) / len(values) if values else None,
            "p50": percentile(values, 0.5), "p90": percentile(values, 0.9),
            "p99": percentile(values, 0.99), "max": max(values) if values else None}


def results_dir(out: str | None, prefix: str) -> Path:
    path = Path(out) if out else RESULTS / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    return path


def plot_cdf(path: Path, series: Mapping[str, Sequence[float]], xlabel: str, title: str,
             points: Mapping[str, Sequence[tuple[float, float]]] | None = None) -> Path:
    """Empirical CDFs of `series`, plus already-cumulative (x, fraction) `points`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, values in series.items():
        if values:
            xs = sorted(values)
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)
    for label, pts in (points or {}).items():
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], "o--", label=label)
    if any(v > 0 for vs in series.values() for v in vs):
        ax.set_xscale("log")  # latencies span ms to seconds
    return _save(fig, ax, path, xlabel, "fraction", title)


def plot_lines(path: Path, xs: Sequence[float], series: Mapping[str, Sequence[float]],
               xlabel: str, ylabel: str, title: str, *, logx: bool = False,
               logy: bool = False, marker: str = "") -> Path:
    """One line per series over the shared `xs`; `marker` (e.g. "o") for sparse points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, ys in series.items():
        ax.plot(xs[: len(ys)], ys, marker=marker or None, label=label)
    if logx:
        ax.set_xscale("log")
        if len(xs) <= 12:  # few points (e.g. concurrency levels): label each one plainly
            from matplotlib.ticker import NullLocator

            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xticks(list(xs), [f"{x:g}" for x in xs])
    if logy:
        ax.set_yscale("log")
    return _save(fig, ax, path, xlabel, ylabel, title)


def _save(fig: Any, ax: Any, path: Path, xlabel: str, ylabel: str, title: str) -> Path:
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def goal_line(name: str, value: float | None, goal: str, ok: bool | None, unit: str = "") -> str:
    shown = "n/a" if value is None else f"{value:.4g}{unit}"
    verdict = "n/a" if ok is None else ("PASS" if ok else "MISS")
    return f"  {name:<44} {shown:>14}   goal {goal:<18} {verdict}"
