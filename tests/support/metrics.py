"""Prometheus text as a flat dict, and lookups by name and labels."""

from __future__ import annotations

import re

# Label values are quoted and may hold braces (a route template's "{response_id}").
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[^}"]|"(?:[^"\\]|\\.)*")*\})?\s+(\S+)$')


def parse_metrics(text: str) -> dict[str, float]:
    """'name{labels}' -> value, labels kept verbatim as Prometheus prints them."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            out[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return out


def m(metrics: dict[str, float], name: str, **labels: str) -> float:
    key = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    return metrics.get(key, 0.0)
