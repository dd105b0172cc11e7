"""A plain `pip install -e .` has no numpy (torch does not require it, tether never uses it): the
pair starts without torch's "Failed to initialize NumPy" warning and serves. numpy is hidden from
both processes here, as this environment has it (the dev tools pull it in)."""

from __future__ import annotations

import os
from pathlib import Path

from tests.support.pair import start_server

# Imported by Python at start from the first sitecustomize on the path.
SHIM = '''import sys


class _NoNumpy:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy" or name.startswith("numpy."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoNumpy())
print("numpy hidden", file=sys.stderr)
'''


def test_a_pair_without_numpy_starts_without_a_warning_and_serves(tmp_path: Path) -> None:
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SHIM)
    path = os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH")) if p)
    # builtin:tiny: the real model path (weights, kernels, sampler), not the weightless sim.
    server = start_server(tmp_path, ["--model", "builtin:tiny"], environ={"PYTHONPATH": path})
    try:
        with server.client() as c:
            answer = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert answer.status_code == 200, answer.text
    finally:
        server.stop()
    for which in ("daemon", "proxy"):
        log = server.log(which)
        assert "numpy hidden" in log, f"the shim did not run in the {which}"
        assert "NumPy" not in log and "Warning" not in log, log[-3000:]
