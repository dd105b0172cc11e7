"""inherited_fifos parses the socket-activation variables; a daemon started the way systemd
starts it (FIFOs open O_RDWR as fds 3..5, LISTEN_PID = its own pid) runs on those fds."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ipc.framing import encode_control, proxy_decoder
from ipc.pipes import ensure_fifos, inherited_fifos
from ipc.records import PROTOCOL_VERSION, Hello, Welcome

REPO = Path(__file__).resolve().parents[2]

# The last step of systemd's service start: move the held fds to 3.., set LISTEN_PID, exec.
_SYSTEMD_EXEC = """
import os, sys
split = sys.argv.index("--")
for target, fd in enumerate(map(int, sys.argv[1:split]), start=3):
    os.dup2(fd, target)
os.environ["LISTEN_PID"] = str(os.getpid())
os.execv(sys.argv[split + 1], sys.argv[split + 1:])
"""

_ACTIVATED_DAEMON = """
import os, sys
from ipc.pipes import DaemonPipes, inherited_fifos
from ipc.records import Hello, Welcome
fds = inherited_fifos()
assert fds == {"requests": 3, "control": 4, "tokens": 5}, fds
assert not any(os.get_inheritable(fd) for fd in fds.values())
pipes = DaemonPipes(sys.argv[1], inherited=fds)
while True:
    pipes.wait_readable(1.0)
    hellos = [r for r in pipes.read_control() if isinstance(r, Hello)]
    if hellos:
        pipes.send([Welcome(hellos[0].version, os.getpid(), "m", 64, hellos[0].epoch,
                            hellos[0].nonce)])
        break
"""


def _env(**values: object) -> dict[str, str]:
    return {k: str(v) for k, v in values.items()}


def test_a_socket_activated_daemon_uses_its_inherited_fifos(tmp_path: Path) -> None:
    paths = ensure_fifos(tmp_path / "sock")
    # What systemd does for ListenFIFO=: it holds each FIFO open O_RDWR before the service
    # starts and hands them over as fds 3, 4, 5, with LISTEN_PID set to the service's pid.
    held = [os.open(paths[name], os.O_RDWR | os.O_NONBLOCK)
            for name in ("requests", "control", "tokens")]
    env = dict(os.environ, PYTHONPATH=str(REPO), LISTEN_FDS="3",
               LISTEN_FDNAMES="requests:control:tokens")
    args = [sys.executable, "-c", _SYSTEMD_EXEC, *map(str, held), "--",
            sys.executable, "-c", _ACTIVATED_DAEMON, str(tmp_path / "unused")]
    daemon = subprocess.Popen(args, env=env, pass_fds=held)
    for fd in held:
        os.close(fd)
    tokens = os.open(paths["tokens"], os.O_RDONLY | os.O_NONBLOCK)
    control = os.open(paths["control"], os.O_WRONLY | os.O_NONBLOCK)  # never ENXIO here
    try:
        os.write(control, encode_control(Hello(PROTOCOL_VERSION, os.getpid(), 3)))
        assert daemon.wait(10) == 0
        welcome = proxy_decoder().feed(os.read(tokens, 65536))
        assert len(welcome) == 1 and isinstance(welcome[0], Welcome)
        assert welcome[0].epoch == 3
        assert not (tmp_path / "unused").exists()  # nothing opened by path
    finally:
        daemon.kill()
        os.close(tokens)
        os.close(control)


def test_fds_meant_for_another_process_are_ignored() -> None:
    env = _env(LISTEN_PID=os.getpid() + 1, LISTEN_FDS=3, LISTEN_FDNAMES="a:b:c")
    assert inherited_fifos(env) is None
    assert inherited_fifos({}) is None
    assert inherited_fifos(_env(LISTEN_PID=os.getpid(), LISTEN_FDS=0)) is None


def test_malformed_variables_are_errors_naming_them() -> None:
    with pytest.raises(ValueError, match="LISTEN_FDS must be an integer"):
        inherited_fifos(_env(LISTEN_PID=os.getpid(), LISTEN_FDS="x"))
    with pytest.raises(ValueError, match="LISTEN_PID must be an integer"):
        inherited_fifos(_env(LISTEN_PID="me", LISTEN_FDS=1))
    with pytest.raises(ValueError, match="LISTEN_FDNAMES has 2 names but LISTEN_FDS is 3"):
        inherited_fifos(_env(LISTEN_PID=os.getpid(), LISTEN_FDS=3, LISTEN_FDNAMES="a:b"))
    with pytest.raises(ValueError, match=r"passes fd \d+, but it is not open"):
        inherited_fifos(_env(LISTEN_PID=os.getpid(), LISTEN_FDS=5000))
