"""docs/cli.md is the ``asiento`` command's ``--help``, regenerated and compared."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from asiento.cli import _docs as _cli_docs
from asiento.cli import main

PAGE = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
REGENERATE = "python -m asiento.cli._docs > docs/cli.md"


def test_every_command_has_a_section_in_the_reference() -> None:
    """Each visible command of `asiento` has its own `## asiento NAME` section in docs/cli.md."""
    documented = set(re.findall(r"^## asiento (\S+)$", PAGE.read_text(), re.M))
    missing = set(_cli_docs.commands()) - documented
    assert not missing, f"undocumented commands {sorted(missing)}: run {REGENERATE}"
    assert documented == set(_cli_docs.commands()), f"stale sections: run {REGENERATE}"


def test_the_reference_is_the_help_of_this_version() -> None:
    """docs/cli.md equals what the generator prints now: no option or text drifted."""
    assert PAGE.read_text() == _cli_docs.reference(), f"docs/cli.md is stale: run {REGENERATE}"


def test_the_reference_shows_what_asiento_help_prints() -> None:
    """The page's help of each command is the one `asiento NAME --help` prints."""
    runner = CliRunner()
    width = {"terminal_width": _cli_docs.WIDTH, "max_content_width": _cli_docs.WIDTH}
    for name in _cli_docs.commands():
        printed = runner.invoke(main, [name, "--help"], prog_name="asiento", **width)
        assert printed.exit_code == 0, printed.output
        assert printed.output.rstrip("\n") == _cli_docs.help_text(name)


def test_the_reference_names_every_option() -> None:
    """Every option of every command appears in its section of docs/cli.md."""
    text = PAGE.read_text()
    for name in _cli_docs.commands():
        section = text.split(f"## asiento {name}\n", 1)[1].split("\n## ", 1)[0]
        for param in main.commands[name].params:
            for flag in getattr(param, "opts", []):
                if flag.startswith("--"):
                    assert flag in section, f"asiento {name} {flag} is not in docs/cli.md"
