"""Suite-wide settings.

Hypothesis: no per-example deadline (a busy 2-core machine makes timings meaningless), and under
CI a fixed seed, so a run there checks the same examples every time instead of finding a new
edge case at random on the day something else is being landed.

`postgres`: one throwaway PostgreSQL server per run, for the store tests and the cluster tests.
"""

import os
from collections.abc import Iterator

import pytest
from hypothesis import settings

from tests.support.postgres import Postgres, pg_bin_dir
from tests.support.wait import free_port

settings.register_profile("tether", deadline=None)
settings.register_profile("tether-ci", deadline=None, derandomize=True)
settings.load_profile("tether-ci" if os.environ.get("CI") else "tether")


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    """One throwaway PostgreSQL server for the whole run (`.ci/run` installs Debian's package)."""
    bin_dir = pg_bin_dir()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql; .ci/run does)")
    server = Postgres(bin_dir, free_port())
    server.start()
    yield server
    server.stop()
