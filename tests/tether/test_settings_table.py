"""docs/operations.md holds every setting as `tether serve --help` shows it."""

import dataclasses
from pathlib import Path

from tether.settings import Settings, env_name
from tether.settings_table import BEGIN, END, markdown

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def test_the_page_holds_the_table_the_settings_make() -> None:
    page = DOCS.read_text()
    held = page[page.index(BEGIN):page.index(END) + len(END)] + "\n"
    assert held == markdown(), "run: python -m tether.settings_table, and paste it in"


def test_every_setting_has_its_row() -> None:
    table = markdown()
    for f in dataclasses.fields(Settings):
        assert f"`{env_name(f.name)}`" in table
