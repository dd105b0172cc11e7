"""`tether serve | daemon | proxy`.

`serve` supervises the other two as child processes (tether/launcher.py); `daemon` and `proxy`
are what the systemd units run. The daemon and the proxy are imported only inside their own
subcommand so that `tether proxy` never loads torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence

from tether import logs, sdnotify, settings
from tether.settings import Settings

COMMANDS: dict[str, str] = {
    "serve": "run the daemon and the proxy together, restarting either if it crashes",
    "daemon": "run the engine alone (the tether-daemon systemd unit)",
    "proxy": "run the HTTP front end alone (the tether-proxy systemd unit)",
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
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text,
                                  usage=f"tether {name} [options]")
        settings.add_arguments(sub)
        sub.set_defaults(subparser=sub)  # errors then show this command's usage line
    return parser


def _serve(s: Settings) -> int | None:
    from tether import launcher

    return launcher.run(s)


def _daemon(s: Settings) -> int | None:
    from daemon import server

    return server.run(s, notify=sdnotify.notify)


def _proxy(s: Settings) -> int | None:
    from proxy import server

    return server.run(s, notify=sdnotify.notify)


_RUNNERS: dict[str, Callable[[Settings], int | None]] = {
    "serve": _serve, "daemon": _daemon, "proxy": _proxy,
}


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> tuple[str, Settings]:
    args = parser.parse_args(argv)
    subparser: argparse.ArgumentParser = args.subparser
    try:
        resolved = settings.resolve(args)
        if resolved.log_level not in logs.LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(logs.LEVELS)}, "
                             f"got {resolved.log_level!r}")
    except ValueError as exc:
        subparser.error(str(exc))  # exit code 2, like any other bad flag
    return args.command, resolved


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        command, resolved = _parse(parser, argv)
    except SystemExit as exc:  # argparse: --help (0) or a bad flag (2)
        return exc.code if isinstance(exc.code, int) else 2
    logs.setup(resolved, command)
    code = _RUNNERS[command](resolved)
    return 0 if code is None else code


if __name__ == "__main__":
    sys.exit(main())
