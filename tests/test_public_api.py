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
    "Budget",
    "BudgetStep",
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


# Run first in a child: psycopg (and psycopg_pool) cannot be imported, as without the extra.
_NO_PSYCOPG = """
import sys
class _NoPsycopg:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("psycopg", "psycopg_pool"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NoPsycopg())
"""


def _without_psycopg(code: str) -> list[str]:
    """What ``code`` prints in a child process where psycopg cannot be imported."""
    done = subprocess.run(
        [sys.executable, "-c", _NO_PSYCOPG + code],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.splitlines()


def test_postgres_without_the_extra_names_the_extra_to_install() -> None:
    """Without psycopg, `from asiento import PostgresCheckpointer` and importing
    asiento.journal.postgres raise an ImportError saying `pip install 'asiento[postgres]'`,
    as open_store and the CLI do; `import asiento` itself still works."""
    probe = (
        "import asiento\n"
        "for attempt in ('from asiento import PostgresCheckpointer',\n"
        "                'import asiento.journal.postgres'):\n"
        "    try:\n"
        "        exec(attempt)\n"
        "    except ImportError as exc:\n"
        "        print(type(exc).__name__, exc.name, '|', exc)\n"
        "    else:\n"
        "        print('imported')\n"
    )
    lines = _without_psycopg(probe)
    assert len(lines) == 2, lines
    for line in lines:
        kind, name, _, message = line.split(" ", 3)
        assert (kind, name) == ("ModuleNotFoundError", "psycopg")
        assert "pip install 'asiento[postgres]'" in message
        assert "No module named 'psycopg'" in message


def test_open_store_without_the_extra_says_it_once() -> None:
    """open_store('postgresql://...') without psycopg is a UsageError naming the extra, once."""
    probe = (
        "import asyncio\n"
        "from asiento import UsageError, open_store\n"
        "try:\n"
        "    asyncio.run(open_store('postgresql://app@127.0.0.1:1/agents'))\n"
        "except UsageError as exc:\n"
        "    print(exc)\n"
    )
    (message,) = _without_psycopg(probe)
    assert message.count("pip install 'asiento[postgres]'") == 1, message
