"""``@tool``: a Python function the model may call, with a schema from its type hints.

Non-idempotent is the default: a tool must declare itself safe to repeat.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, get_type_hints, overload

import pydantic

from .errors import UsageError
from .model import ToolSchema

if TYPE_CHECKING:
    from .effects.base import Effect

ToolFunction = Callable[..., Any]


class ToolArgumentsError(ValueError):
    """The model's arguments do not fit the tool's signature."""


@dataclass(frozen=True, slots=True)
class Tool:
    """A callable tool with its JSON schema and its repeat-safety declared."""

    name: str
    description: str
    idempotent: bool
    fn: ToolFunction
    arguments_model: type[pydantic.BaseModel]
    effect: Effect | None = None

    @property
    def schema(self) -> ToolSchema:
        parameters = self.arguments_model.model_json_schema()
        parameters.pop("title", None)
        return ToolSchema(name=self.name, description=self.description, parameters=parameters)

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The keyword arguments to call the function with, or ``ToolArgumentsError``."""
        try:
            model = self.arguments_model.model_validate(dict(arguments))
        except pydantic.ValidationError as exc:
            raise ToolArgumentsError(f"invalid arguments for tool {self.name!r}: {exc}") from None
        return {name: getattr(model, name) for name in type(model).model_fields}

    async def invoke(self, arguments: Mapping[str, Any]) -> Any:
        """Run the tool once. Sync tools run in the event loop's thread."""
        kwargs = self.validate(arguments)
        result = self.fn(**kwargs)
        if inspect.isawaitable(result):
            return await result
        return result

    def with_effect(self, effect: Effect) -> Tool:
        """This tool, published through ``effect`` (prepare / publish / confirm)."""
        return dataclasses.replace(self, effect=effect, idempotent=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


@overload
def tool(fn: ToolFunction, /) -> Tool: ...


@overload
def tool(
    *, idempotent: bool = False, name: str | None = None, description: str | None = None
) -> Callable[[ToolFunction], Tool]: ...


def tool(
    fn: ToolFunction | None = None,
    /,
    *,
    idempotent: bool = False,
    name: str | None = None,
    description: str | None = None,
) -> Tool | Callable[[ToolFunction], Tool]:
    """Turn a function into a ``Tool``; ``@tool`` and ``@tool(idempotent=True)`` both work."""

    def wrap(f: ToolFunction) -> Tool:
        if not callable(f):
            raise UsageError(f"@tool decorates a function, got {f!r}")
        if not isinstance(idempotent, bool):
            raise UsageError(f"@tool(idempotent=...) takes True or False, got {idempotent!r}")
        tool_name = name or f.__name__
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", tool_name):
            raise UsageError(f"tool name {tool_name!r} must be 1-64 letters, digits, _ or -")
        summary, params = _parse_docstring(inspect.getdoc(f) or "")
        model = _arguments_model(f, tool_name, params)
        return Tool(tool_name, description or summary, idempotent, f, model)

    return wrap(fn) if fn is not None else wrap


def _arguments_model(
    f: ToolFunction, tool_name: str, docs: Mapping[str, str]
) -> type[pydantic.BaseModel]:
    try:
        hints = get_type_hints(f)
    except Exception as exc:
        raise UsageError(f"tool {tool_name!r}: cannot resolve its type hints: {exc}") from exc
    fields: dict[str, Any] = {}
    for param in inspect.signature(f).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise UsageError(
                f"tool {tool_name!r}: *args and **kwargs cannot be described to a model"
            )
        default = ... if param.default is param.empty else param.default
        annotation = hints.get(param.name, Any)
        fields[param.name] = (annotation, pydantic.Field(default, description=docs.get(param.name)))
    config = pydantic.ConfigDict(extra="forbid")
    try:
        return pydantic.create_model(f"{tool_name}_arguments", __config__=config, **fields)
    except Exception as exc:
        raise UsageError(f"tool {tool_name!r}: its signature has no JSON schema: {exc}") from exc


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """The summary paragraph and the ``Args:`` descriptions of a Google-style docstring."""
    summary = doc.split("\n\n", 1)[0].strip()
    params: dict[str, str] = {}
    in_args = False
    for line in doc.splitlines():
        if line.strip() in ("Args:", "Arguments:", "Parameters:"):
            in_args = True
            continue
        match = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?:\s*(.+)", line) if in_args else None
        if match:
            params[match.group(1)] = match.group(2).strip()
        elif in_args and line and not line[0].isspace():
            in_args = False
    return summary, params
