from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

import tether
from tests.support.systemd import child_env
from tether import cli, settings
from tether.launcher import child_environ
from tether.settings import Settings

ENV_NAMES = [settings.env_name(f.name) for f in dataclasses.fields(Settings)]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("command", ["serve", "daemon", "proxy"])
def test_help_lists_every_flag_and_variable(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([command, "--help"]) == 0
    out = capsys.readouterr().out
    for f in dataclasses.fields(Settings):
        assert "--" + f.name.replace("_", "-") in out
        assert settings.env_name(f.name) in out


def test_help_groups_the_flags_model_first_then_server(
        capsys: pytest.CaptureFixture[str]) -> None:
    names = [n for _, group in settings.GROUPS for n in group]
    assert sorted(names) == sorted(f.name for f in dataclasses.fields(Settings))  # each once
    assert cli.main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    titles = [t for t, _ in settings.GROUPS]
    assert titles == ["model", "server", "engine", "store", "limits", "logging"]
    at = [out.index(f"\n{t}:\n") for t in titles]
    assert at == sorted(at)
    flags = [line.split()[0] for line in out.splitlines() if line.startswith("  --")]
    assert flags[:2] == ["--model", "--served-model-name"]
    assert flags[flags.index("--tool-call-parser") + 1] == "--port"


def test_top_level_help_lists_commands_and_variables(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    for command in cli.COMMANDS:
        assert command in out
    for name in ENV_NAMES:
        assert name in out


def test_version_prints_and_exits_zero() -> None:
    done = subprocess.run([sys.executable, "-m", "tether.cli", "--version"], capture_output=True,
                          text=True, env=child_env(), timeout=60)
    assert (done.returncode, done.stdout) == (0, f"tether {tether.__version__}\n"), done.stderr


def _resolve(argv: list[str], environ: dict[str, str]) -> Settings:
    return settings.resolve(cli.build_parser().parse_args(argv), environ)


def test_flag_beats_variable_beats_default() -> None:
    s = _resolve(["proxy", "--port", "9001"],
                 {"TETHER_PORT": "9002", "TETHER_MAX_NUM_SEQS": "7"})
    assert (s.port, s.max_num_seqs, s.max_waiting) == (9001, 7, Settings().max_waiting)


def test_api_keys_repeat_as_flags_and_split_as_a_variable() -> None:
    assert _resolve(["proxy", "--api-key", "a", "--api-key", "b"], {}).api_key == ["a", "b"]
    assert _resolve(["proxy"], {"TETHER_API_KEY": "a, b,"}).api_key == ["a", "b"]


def test_prefix_caching_is_on_unless_turned_off_by_flag_or_variable() -> None:
    assert _resolve(["daemon"], {}).prefix_caching is True
    assert _resolve(["daemon", "--no-prefix-caching"], {}).prefix_caching is False
    assert _resolve(["daemon"], {"TETHER_PREFIX_CACHING": "0"}).prefix_caching is False
    assert _resolve(["daemon", "--prefix-caching"],
                    {"TETHER_PREFIX_CACHING": "off"}).prefix_caching is True


def test_a_bad_boolean_variable_lists_the_accepted_words(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TETHER_PREFIX_CACHING", "maybe")
    assert cli.main(["daemon"]) == 2
    err = capsys.readouterr().err
    assert "TETHER_PREFIX_CACHING" in err and "'maybe'" in err and "false" in err


@pytest.mark.parametrize(("argv", "named"), [
    (["serve", "--port", "eighty"], "--port"),
    (["serve", "--port", "70000"], "--port"),
    (["daemon", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["daemon", "--dtype", "int3"], "--dtype"),
    (["daemon", "--tensor-parallel-size", "0"], "--tensor-parallel-size"),
    (["daemon", "--kernels", "fast"], "--kernels"),
    (["daemon", "--quantization", "int2"], "--quantization"),
    (["daemon", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["daemon", "--gpu-memory-utilization", "nan"], "--gpu-memory-utilization"),
    (["daemon", "--gpu-memory-utilization", "0.9", "--kv-cache-mib", "64"],
     "--gpu-memory-utilization"),
    (["daemon", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 3}'],
     "--speculative-config: method"),
    (["daemon", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
     "--speculative-config: prompt_lookup_max"),
    (["proxy", "--drain-timeout-s", "soon"], "--drain-timeout-s"),
    (["proxy", "--log-format", "xml"], "--log-format"),
    (["proxy", "--log-level", "loud"], "--log-level"),
    (["proxy", "--no-such-flag"], "--no-such-flag"),
    (["launch"], "launch"),
])
def test_bad_flag_exits_2_naming_it(
        argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 2
    assert named in capsys.readouterr().err


def test_bad_variable_exits_2_naming_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TETHER_KV_CACHE_BLOCKS", "lots")
    assert cli.main(["daemon"]) == 2
    assert "TETHER_KV_CACHE_BLOCKS" in capsys.readouterr().err


def test_bad_value_from_the_console_script_exits_2() -> None:
    proc = subprocess.run([sys.executable, "-m", "tether.cli", "proxy", "--port", "x"],
                          capture_output=True, text=True, timeout=60, env=child_env())
    assert proc.returncode == 2
    assert "tether proxy: error: --port" in proc.stderr


def test_launcher_passes_every_setting_to_its_children() -> None:
    s = Settings(runtime_dir=Path("/run/x"), state_dir=Path("/var/lib/x"), model="/m",
                 port=9000, api_key=["k1", "k2"], drain_timeout_s=2.5, pipe_group=None,
                 log_format="json", max_num_seqs=3)
    env = child_environ(s, "@sock")
    assert env["NOTIFY_SOCKET"] == "@sock"
    assert int(env["WATCHDOG_USEC"]) > 0
    assert settings.resolve(cli.build_parser().parse_args(["daemon"]), env) == s
    assert settings.resolve(
        cli.build_parser().parse_args(["daemon"]), child_environ(Settings(), "@s")) == Settings()


def test_cli_and_launcher_do_not_import_the_engine() -> None:
    code = ("import sys, tether.cli, tether.launcher, tether.logs; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'daemon')); "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=child_env())
    assert proc.returncode == 0, proc.stderr


def test_daemon_with_a_missing_model_exits_1_naming_it(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tether.cli", "daemon", "--model", str(tmp_path / "nope"),
         "--runtime-dir", str(tmp_path / "run"), "--state-dir", str(tmp_path / "state"),
         "--log-format", "text"],
        capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1
    assert str(tmp_path / "nope") in proc.stderr
    assert "Traceback" not in proc.stderr


def test_daemon_with_a_model_that_does_not_split_exits_1_naming_the_field(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tether.cli", "daemon", "--model", "builtin:small",
         "--tensor-parallel-size", "2", "--runtime-dir", str(tmp_path / "run"),
         "--state-dir", str(tmp_path / "state"), "--log-format", "text"],
        capture_output=True, text=True, timeout=120, check=False, env=child_env())
    assert proc.returncode == 1
    assert "num_attention_heads (9) is not divisible by --tensor-parallel-size 2" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_open_files_limit_is_raised_to_the_hard_one() -> None:
    """systemd starts a service at a soft limit of 1024 under a higher hard one; each command
    starts by raising it (tests/e2e/test_connection_limits.py sees the proxy's), and says so."""
    code = ("import logging, resource, sys\n"
            "_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))\n"
            "logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
            "from tether import cli\n"
            "cli.raise_open_files_limit()\n"
            "print('limits', *resource.getrlimit(resource.RLIMIT_NOFILE))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=child_env())
    assert proc.returncode == 0, proc.stderr
    soft, hard = map(int, proc.stdout.split("limits ")[1].split())
    assert soft == hard
    if hard > 256:
        assert f"open-files limit raised from 256 to {hard}" in proc.stdout
