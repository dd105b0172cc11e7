"""deploy/monitoring: the Grafana dashboard and the Prometheus alert rules against a real pair.

Driven by the files' own queries: a panel or rule added later for a new metric is checked the same
way, with no list of metric names here."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.support.pair import CHAT, Server, drop, post_raw, start_server, wait_aborts
from tests.support.raw_http import read_events
from tests.support.wait import free_port, wait_for

pytestmark = pytest.mark.timeout(300)

MONITORING = Path(__file__).parents[2] / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana-dashboard.json"
RULES = MONITORING / "tether-alerts.yml"
RULE_TESTS = MONITORING / "tether-alerts.test.yml"

_METRIC = re.compile(r"\btether_[a-zA-Z0-9_:]+")
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")
_MATCHERS = re.compile(r"\{([^{}]*)\}")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s")
TARGET_LABELS = {"job", "instance"}  # added by Prometheus at scrape time, not in /metrics


def dashboard_queries() -> list[str]:
    """Every PromQL expression in the dashboard: panel targets and template variables."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("expr", "definition") and isinstance(value, str):
                    found.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(json.loads(DASHBOARD.read_text()))
    return found


def rule_queries() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def live_labels(text: str) -> dict[str, set[str]]:
    """Sample name -> the label names its samples carry, from Prometheus text."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            labels = re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', match.group(2) or "")
            out.setdefault(match.group(1), set()).update(labels)
    return out


def labels_used(expr: str) -> set[str]:
    names = {n.strip() for group in _LABEL_LISTS.findall(expr) for n in group.split(",")}
    for group in _MATCHERS.findall(expr):
        names |= set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", group))
    return {n for n in names if n} - TARGET_LABELS


@pytest.fixture(scope="module")
def busy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A real pair that has served, streamed and aborted, so every labelled series exists."""
    server = start_server(tmp_path_factory.mktemp("monitoring"), ["--max-num-seqs", "4"])
    try:
        with server.client() as c:
            c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4}).raise_for_status()
            c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "stream": True}).raise_for_status()
        sock = post_raw(server, "/v1/chat/completions", {**CHAT, "stream": True})
        read_events(sock, 3)
        drop(sock)
        wait_aborts(server, "client_disconnect", 1)
        yield server
    finally:
        server.stop()


def check_against_live_metrics(queries: list[str], text: str) -> None:
    live = live_labels(text)
    assert queries
    for expr in queries:
        names = set(_METRIC.findall(expr))
        missing = names - set(live)
        assert not missing, f"{expr!r} queries {sorted(missing)}, absent from /metrics"
        carried = set().union(*(live[n] for n in names)) if names else set()
        assert labels_used(expr) <= carried, (expr, sorted(labels_used(expr) - carried))


def test_every_dashboard_query_reads_live_metrics(busy_server: Server) -> None:
    text = httpx.get(busy_server.url + "/metrics", timeout=10).text
    check_against_live_metrics(dashboard_queries(), text)


def test_every_alert_rule_reads_live_metrics(busy_server: Server) -> None:
    text = httpx.get(busy_server.url + "/metrics", timeout=10).text
    assert len(rule_queries()) == 5
    check_against_live_metrics(rule_queries(), text)


def test_labels_used_finds_grouping_and_matchers() -> None:  # the check above can fail
    expr = 'sum by (le, endpoint) (rate(x_bucket{job=~"$job", cause="a", pipe!~"b"}[1m]))'
    assert labels_used(expr) == {"le", "endpoint", "cause", "pipe"}
    with pytest.raises(AssertionError, match="absent from /metrics"):
        check_against_live_metrics(["tether_no_such_metric"], "tether_up 1\n")
    with pytest.raises(AssertionError):
        check_against_live_metrics(['sum by (reason) (tether_up)'], "tether_up 1\n")


def promtool() -> str:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool not installed (Debian package prometheus); .ci/run installs it")
    return tool


def test_alert_rules_pass_promtool_check() -> None:
    r = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 5 rules found" in r.stdout


def test_alert_rules_unit_tests() -> None:
    r = subprocess.run([promtool(), "test", "rules", RULE_TESTS.name], cwd=MONITORING,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dashboard_queries_evaluate_in_a_real_prometheus(busy_server: Server,
                                                         tmp_path: Path) -> None:
    """Prometheus scrapes the pair and loads the rules; each panel query must return series."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not installed (Debian package prometheus); .ci/run installs it")
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(json.dumps({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "tether", "static_configs": [
            {"targets": [f"127.0.0.1:{busy_server.port}"]}]}]}))
    proc = subprocess.Popen(
        [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))
    api = f"http://127.0.0.1:{port}/api/v1/"

    def query(expr: str) -> list[Any]:
        r = httpx.get(api + "query", params={"query": expr}, timeout=10).json()
        assert r["status"] == "success", (expr, r)
        return list(r["data"]["result"])

    def scraped_thrice() -> bool:  # rate() needs two scrapes in its window
        if not _ready(api):
            return False
        result = query("tether_engine_ticks_total[10s]")
        return bool(result) and len(result[0]["values"]) >= 3

    def rules_evaluated() -> bool:
        groups = httpx.get(api + "rules", timeout=10).json()["data"]["groups"]
        return all(r["health"] == "ok" for g in groups for r in g["rules"])

    try:
        wait_for(scraped_thrice, 60, "three scrapes of the pair")
        for expr in dashboard_queries():
            if expr.startswith("label_values("):
                continue  # a Grafana function, not PromQL; its metric is checked above
            promql = (expr.replace("$__rate_interval", "10s").replace("$job", ".*")
                      .replace("$instance", ".*"))
            assert query(promql), f"no series for {expr!r}"
        groups = httpx.get(api + "rules", timeout=10).json()["data"]["groups"]
        assert sum(len(g["rules"]) for g in groups) == len(rule_queries())
        wait_for(rules_evaluated, 30, "every alert rule evaluated without error")
    finally:
        proc.terminate()
        proc.wait(30)


def _ready(api: str) -> bool:
    try:
        return httpx.get(api.removesuffix("api/v1/") + "-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
