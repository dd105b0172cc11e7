"""Process plumbing shared by whatever spawns a child: how it ended, and dying with its parent.

The launcher supervises the daemon and the proxy, the daemon its tensor-parallel ranks; both
word a child's exit the same way and tie its life to theirs the same way. No torch here.
"""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1
# Loaded once at import: `die_with_parent` runs between fork and exec, no place for dlopen.
_libc = ctypes.CDLL(None, use_errno=True)


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


def die_with_parent(parent_pid: int, sig: int) -> None:
    """Have the kernel send `sig` to this process when its parent dies, even by SIGKILL; exit
    at once if the parent died before that took effect. Safe as a Popen preexec_fn."""
    _libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)
