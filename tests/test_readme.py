"""The README stays true: every `rope-export` command in it parses with the real command line, every page it
links exists, and it stays a first read (under 250 lines)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from rope_export import cli

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _commands() -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", README, flags=re.S)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    lines += [c for c in re.findall(r"`(rope-export [^`]+)`", README) if len(c.split()) > 2]  # whole ones in the text
    return [line for line in lines if line.startswith("rope-export ") and "--help" not in line
            and "COMMAND" not in line]


def test_the_readme_is_a_first_read():
    assert len(README.splitlines()) <= 250
    first_screen = "\n".join(README.splitlines()[:8])
    assert "make demo" in first_screen and "make test" in first_screen
    for step in ("export --hf", "rope-export lower", "rope-export check", "package genai", "export_module"):
        assert step in README, step


@pytest.mark.parametrize("command", _commands())
def test_every_readme_command_parses(command):
    parser = cli.build_parser()
    args = parser.parse_args(shlex.split(command)[1:])  # argparse exits on an unknown option or a bad value
    assert args.command == shlex.split(command)[1]


def test_the_lowering_table_lists_every_target():
    from rope_export.passes.targets import TARGET_HELP

    for target in TARGET_HELP:
        assert f"| `{target}` |" in README, target


def test_every_linked_page_exists():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    assert links
    for link in links:
        if not link.startswith("http"):
            assert (ROOT / link).is_file(), link
    for page in (ROOT / "docs").glob("*.md"):  # and every page is reachable from the README
        assert f"docs/{page.name}" in README, page.name
