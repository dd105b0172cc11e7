"""docs/operations.md's table of every setting, made from the settings themselves (their groups,
defaults and help), so the page cannot drift from `tether serve --help`.

    python -m tether.settings_table     # prints the table that docs/operations.md holds
"""

from __future__ import annotations

import dataclasses

from tether.settings import _HELP, GROUPS, Settings, env_name

BEGIN = "<!-- the settings: made by `python -m tether.settings_table`; do not edit by hand -->"
END = "<!-- end of the settings -->"
# Defaults that depend on the machine, as the page says them.
_MACHINE = {"runtime_dir": "`$XDG_RUNTIME_DIR/tether`, else `/tmp/tether-$UID`",
            "state_dir": "`~/.local/state/tether`"}


def _default(name: str, value: object) -> str:
    if name in _MACHINE:
        return _MACHINE[name]
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return ", ".join(value) if value else "none"
    if value is None or value == "":
        return "none"
    return f"`{value}`"


def _flag(name: str, value: object) -> str:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        flag = f"--[no-]{name.replace('_', '-')}"
    return f"`{flag}` / `{env_name(name)}`"


def markdown() -> str:
    defaults = Settings()
    fields = {f.name for f in dataclasses.fields(Settings)}
    out = [BEGIN]
    for title, names in GROUPS:
        assert set(names) <= fields, set(names) - fields
        out += ["", f"**{title}**", "", "| flag / variable | default | meaning |", "|---|---|---|"]
        for name in names:
            value = getattr(defaults, name)
            meaning = _HELP[name].replace("|", "\\|").replace("<", "&lt;")
            out.append(f"| {_flag(name, value)} | {_default(name, value)} | {meaning} |")
    out += ["", END]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
