"""Which package may import which: the CLI may be used by the testing helpers, never the
other way round as well (a circle of imports)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "asiento"


def _imports(module: Path) -> set[str]:
    """The asiento modules ``module`` imports, as dotted names relative to the package."""
    found: set[str] = set()
    package = module.parent.relative_to(SRC).parts
    for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - (node.level - 1)]) if node.level else []
            name = ".".join([*base, *(node.module or "").split(".")]).strip(".")
            if node.level or name.startswith("asiento"):
                found.add(name.removeprefix("asiento").strip("."))
        elif isinstance(node, ast.Import):
            found |= {
                a.name.removeprefix("asiento.") for a in node.names if a.name.startswith("asiento")
            }
    return found


def test_the_cli_never_imports_the_testing_helpers() -> None:
    offenders = {
        str(path.relative_to(SRC)): sorted(
            n for n in _imports(path) if n.split(".")[0] == "testing"
        )
        for path in (SRC / "cli").rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}
