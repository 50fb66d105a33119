"""The public surface: __all__, the documented names, constructors and the error tree."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys
from types import ModuleType

import click

import asiento
from asiento import AsientoError, ModelResponse, ToolCall

DOCUMENTED = [
    "Agent",
    "Session",
    "SqliteCheckpointer",
    "MemoryCheckpointer",
    "Checkpointer",
    "tool",
    "StepEvent",
    "ModelStep",
    "ToolStep",
    "ApprovalStep",
    "FinalStep",
    "ModelRequest",
    "ModelResponse",
    "ToolCall",
    "UncertainEffect",
    "approve",
    "deny",
    "AsientoError",
    "UsageError",
]


def test_all_is_sorted_and_unique() -> None:
    """__all__ is sorted and lists each name once."""
    assert list(asiento.__all__) == sorted(set(asiento.__all__))


def test_every_name_in_all_resolves() -> None:
    """Every name in __all__ is an attribute of the package."""
    missing = [name for name in asiento.__all__ if not hasattr(asiento, name)]
    assert missing == []


def test_documented_names_are_exported() -> None:
    """Every class and function named in DESIGN.md's API section is in __all__."""
    assert [name for name in DOCUMENTED if name not in asiento.__all__] == []


def test_plain_constructors_need_only_keywords() -> None:
    """ModelResponse() and ToolCall(name=...) construct with every other field defaulted."""
    response = ModelResponse()
    assert (response.text, response.tool_calls, response.request_id) == ("", (), None)
    call = ToolCall(name="x")
    assert (call.name, dict(call.arguments), call.id) == ("x", {}, "")


def _modules() -> list[ModuleType]:
    """asiento and its submodules that import here (optional extras may be missing)."""
    modules = [asiento]
    for info in pkgutil.walk_packages(asiento.__path__, "asiento."):
        if info.name.endswith("__main__"):
            continue  # the CLI entry point runs on import
        try:
            modules.append(importlib.import_module(info.name))
        except ModuleNotFoundError as exc:
            if (exc.name or "").startswith("asiento"):
                raise
    return modules


def test_every_error_class_derives_from_asiento_error() -> None:
    """Every exception class asiento defines is an AsientoError.

    The CLI's click exceptions are exempt: click turns them into an exit status.
    Private classes (a leading underscore) never leave their module.
    """
    strays = {
        f"{cls.__module__}.{cls.__qualname__}"
        for module in _modules()
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, BaseException)
        and cls.__module__.startswith("asiento")
        and not cls.__name__.startswith("_")
        and not issubclass(cls, AsientoError | click.ClickException)
    }
    assert strays == set()


def test_import_loads_no_optional_or_heavy_dependency() -> None:
    """`import asiento` (every child process a crash harness forks, every worker) loads no
    HTTP client, database driver, provider SDK or CLI toolkit until one is used."""
    probe = (
        "import sys, asiento, asiento.effects\n"
        "heavy = ('httpx', 'psycopg', 'psycopg_pool', 'openai', 'anthropic', 'rich', 'click',"
        " 'starlette')\n"
        "print(','.join(m for m in heavy if m in sys.modules))\n"
        "from asiento.effects import HttpEffect\n"
        "print(HttpEffect.__name__, 'httpx' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.splitlines() == ["", "HttpEffect True"], done.stdout
