"""The module-scoped pairs the e2e tests share; the harness itself is in tests/support/pair.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.pair import ABORT_MODEL, Server, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("e2e"), ["--max-num-seqs", "8"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def abort_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """builtin:small (ticks of ~50 ms), so that a drop is judged from the client's close."""
    s = start_server(tmp_path_factory.mktemp("e2e-abort"), ["--max-num-seqs", "8", *ABORT_MODEL])
    yield s
    s.stop()
