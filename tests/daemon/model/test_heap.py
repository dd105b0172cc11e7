"""keep_heap: a tick's large temporaries come from the heap and their pages stay in it.

Each case runs in its own interpreter (the thresholds are process-wide): a 24 MiB block (two of
a 64-sequence tick's logits tensors at a 49k vocabulary) is allocated and freed, and glibc's
mallinfo2 says whether it was mapped on its own and how much more heap there is after
the free. (A page-fault count of the tick itself moves with glibc's heap layout from run to run;
bench_decode measures that: docs/benchmarks.md.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from daemon.model.device import keep_heap

PROBE = """
import ctypes, json, sys
from daemon.model.device import keep_heap

class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "keep":
    assert keep_heap()
before = libc.mallinfo2()
block = libc.malloc(24 << 20)
ctypes.memset(block, 1, 24 << 20)
mapped = libc.mallinfo2().hblks - before.hblks
libc.free(block)
print(json.dumps({"mapped": mapped, "heap_kept": libc.mallinfo2().arena - before.arena}))
"""


def probe(mode: str) -> dict[str, int]:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                          timeout=120, check=True)
    return json.loads(done.stdout)


@pytest.mark.skipif(not keep_heap(), reason="glibc's mallopt only")
def test_kept_heap_holds_a_ticks_temporaries() -> None:
    kept = probe("keep")
    assert kept["mapped"] == 0  # from the heap
    assert kept["heap_kept"] >= 24 << 20  # and still there for the next tick
    default = probe("default")  # what the setting is for: glibc maps it, and unmaps it
    assert default["mapped"] == 1
    assert default["heap_kept"] < 24 << 20
