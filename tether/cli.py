"""`tether serve | daemon | proxy`.

`serve` supervises the other two as child processes (tether/launcher.py); `daemon` and `proxy`
are what the systemd units run. The daemon and the proxy are imported only inside their own
subcommand so that `tether proxy` never loads torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import resource
import sys
from collections.abc import Callable, Sequence

import tether
from ipc import dir_lock
from ipc.dir_lock import Role
from ipc.fifo import PipeError
from tether import logs, options, sdnotify, settings
from tether.settings import Settings

log = logging.getLogger("tether.cli")

COMMANDS: dict[str, str] = {
    "serve": "run the daemon and the proxy together, restarting either if it crashes",
    "daemon": "run the engine alone (the tether-daemon systemd unit)",
    "proxy": "run the HTTP front end alone (the tether-proxy systemd unit)",
    "cluster": "run N daemon+proxy pairs on this machine behind the smg router, one shared store",
}


def _env_summary() -> str:
    names = ", ".join(settings.env_name(f.name) for f in dataclasses.fields(Settings))
    return ("Every flag is also an environment variable (the flag wins): "
            f"{names}. See `tether serve --help` for what each one does.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tether",
        description="OpenAI-compatible LLM server that stops work the moment a client goes away.",
        epilog=_env_summary(),
    )
    parser.add_argument("--version", action="version", version=f"tether {tether.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text,
                                  usage=f"tether {name} [options]")
        settings.add_arguments(sub)
        if name == "cluster":
            _add_cluster_arguments(sub)
        sub.set_defaults(subparser=sub)  # errors then show this command's usage line
    return parser


def _add_cluster_arguments(sub: argparse.ArgumentParser) -> None:
    from tether.cluster import POLICIES

    def replicas(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected int, got {text!r}") from None
        if n < 1:
            raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
        return n

    sub.add_argument("--replicas", type=replicas, default=2,
                     help="pairs to run; replica i listens on --port + 1 + i [default 2]")
    sub.add_argument("--router-policy", choices=POLICIES, default="round_robin",
                     help="smg's load-balancing policy [default round_robin]")


def _serve(s: Settings, args: argparse.Namespace) -> int | None:
    from tether import launcher

    return launcher.run(s)


def _daemon(s: Settings, args: argparse.Namespace) -> int | None:
    def run() -> int | None:
        from daemon import main as server

        return server.run(options.daemon_options(s), notify=sdnotify.notify)

    return _owning(s, Role.DAEMON, run)


def _proxy(s: Settings, args: argparse.Namespace) -> int | None:
    def run() -> int | None:
        from proxy import server

        return server.run(options.proxy_options(s), notify=sdnotify.notify)

    return _owning(s, Role.PROXY, run)


def _owning(s: Settings, role: Role, run: Callable[[], int | None]) -> int | None:
    """`run` while this process holds `role`'s lock on the runtime directory (ipc/dir_lock.py);
    taken before the model or the app is loaded, so a second pair is refused at once."""
    try:
        lock = dir_lock.take(s.runtime_dir, role, s.pipe_group)
    except PipeError as exc:
        log.error("%s", exc)
        return 1
    try:
        return run()
    finally:
        lock.release()


def _cluster(s: Settings, args: argparse.Namespace) -> int | None:
    from tether import cluster

    return cluster.run(s, args.replicas, args.router_policy)


_RUNNERS: dict[str, Callable[[Settings, argparse.Namespace], int | None]] = {
    "serve": _serve, "daemon": _daemon, "proxy": _proxy, "cluster": _cluster,
}


def _parse(parser: argparse.ArgumentParser,
           argv: Sequence[str] | None) -> tuple[argparse.Namespace, Settings]:
    args = parser.parse_args(argv)
    subparser: argparse.ArgumentParser = args.subparser
    try:
        resolved = settings.resolve(args)
        if resolved.log_level not in logs.LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(logs.LEVELS)}, "
                             f"got {resolved.log_level!r}")
    except ValueError as exc:
        subparser.error(str(exc))  # exit code 2, like any other bad flag
    return args, resolved


def raise_open_files_limit() -> None:
    """The soft open-files limit up to the hard one. systemd starts a service at 1024 (hard:
    524288), fewer than the proxy's connections need; the units set LimitNOFILE= as well, and
    the proxy caps its connections under whatever limit it ends up with."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard or hard == resource.RLIM_INFINITY:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.warning("cannot raise the open-files limit from %d to %d: %s", soft, hard, exc)
        return
    log.info("open-files limit raised from %d to %d (the hard limit)", soft, hard)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, resolved = _parse(parser, argv)
    except SystemExit as exc:  # argparse: --help (0) or a bad flag (2)
        return exc.code if isinstance(exc.code, int) else 2
    logs.setup(resolved, args.command)
    raise_open_files_limit()
    code = _RUNNERS[args.command](resolved, args)
    return 0 if code is None else code


if __name__ == "__main__":
    sys.exit(main())
