"""Settings become the daemon's and the proxy's option objects: none is dropped on the way, and
daemon/, proxy/ and ipc/ take their options without importing tether/."""

from __future__ import annotations

import ast
import dataclasses
import socket
from pathlib import Path

import pytest

from tether.options import daemon_options, proxy_options
from tether.settings import Settings

ROOT = Path(__file__).parents[2]
# Values the conversion itself reads (a valid log level); any other field gets a changed default.
OTHER = {"log_level": "debug", "log_format": "text", "api_key_scope": "all"}
# Two ranks, so that the log settings reach the spawned rank's logging config too.
BASE = Settings(tensor_parallel_size=2)


def _another(name: str, default: object) -> object:
    if name in OTHER:
        return OTHER[name]
    if isinstance(default, bool):
        return not default
    if isinstance(default, int | float):
        return default + 1
    if isinstance(default, Path):
        return default / "elsewhere"
    if isinstance(default, list):
        return [*default, "another"]
    return f"{default or ''}another"


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(Settings)])
def test_every_setting_reaches_an_option(name: str) -> None:
    changed = dataclasses.replace(BASE, **{name: _another(name, getattr(BASE, name))})
    assert getattr(changed, name) != getattr(BASE, name)
    assert (daemon_options(changed), proxy_options(changed)) != (
        daemon_options(BASE), proxy_options(BASE)), f"--{name.replace('_', '-')} is dropped"


def test_the_replica_id_and_the_store_default_to_this_pair() -> None:
    store = daemon_options(Settings(port=8123, state_dir=Path("/var/lib/t"))).store
    assert store.replica_id == f"{socket.gethostname()}:8123"
    assert store.location == Path("/var/lib/t/responses.sqlite3")
    store = daemon_options(Settings(replica_id="a", state_url="postgresql://h/db")).store
    assert (store.replica_id, store.location) == ("a", "postgresql://h/db")


def test_each_spawned_rank_gets_its_own_logging() -> None:
    configs = daemon_options(Settings(tensor_parallel_size=3)).model.rank_log_configs
    assert [c["formatters"]["tether"]["component"] for c in configs] == [
        "daemon rank 1", "daemon rank 2"]
    assert daemon_options(Settings()).model.rank_log_configs == ()


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", ["daemon", "proxy", "ipc"])
def test_the_packages_below_do_not_import_tether(package: str) -> None:
    offenders = {str(p.relative_to(ROOT)): sorted(n for n in _imported(p)
                                                  if n == "tether" or n.startswith("tether."))
                 for p in sorted((ROOT / package).rglob("*.py"))}
    assert not {p: names for p, names in offenders.items() if names}
