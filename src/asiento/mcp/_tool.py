"""An MCP tool as an asiento ``Tool``: the server's JSON schema, its treatment, its runner.

The model sees the schema the server listed; the arguments are checked against it
before anything is recorded as submitted, so arguments that do not fit are the
step's recorded failure, as for a local tool.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # a dependency of mcp, without stubs
import pydantic

from ..model import ToolSchema
from ..tools import Tool, ToolArgumentsError
from ._annotations import UNTRUSTED, Treatment

_ANY_ARGUMENTS = pydantic.create_model(
    "mcp_arguments", __config__=pydantic.ConfigDict(extra="allow")
)


@dataclasses.dataclass(frozen=True, slots=True)
class McpTool(Tool):
    """A tool listed by an MCP server (``server``), called there as ``remote_name``.

    ``listed``: what the server said about it beyond its name and schema (its
    annotations, its output schema), kept so a resumed run can tell it changed.
    """

    input_schema: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    server: str = ""
    remote_name: str = ""
    treatment: Treatment = UNTRUSTED
    listed: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def schema(self) -> ToolSchema:
        return ToolSchema(
            name=self.name, description=self.description, parameters=dict(self.input_schema)
        )

    @property
    def destructive(self) -> bool:
        return self.treatment.destructive

    @property
    def source(self) -> dict[str, Any]:
        return {
            "mcp": self.server,
            "tool": self.remote_name,
            "listed": dict(self.listed),
            "treatment": self.treatment.to_json(),
        }

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The arguments, checked against the server's JSON schema (``ToolArgumentsError``)."""
        args = dict(arguments)
        try:
            validator = jsonschema.validators.validator_for(self.input_schema)(self.input_schema)
            problems = sorted(validator.iter_errors(args), key=lambda e: list(e.path))
        except jsonschema.SchemaError as exc:
            raise ToolArgumentsError(
                f"the MCP server {self.server!r} lists tool {self.remote_name!r} with a "
                f"schema that is not valid JSON Schema: {exc.message}"
            ) from None
        if problems:
            where = "/".join(str(p) for p in problems[0].path) or "(arguments)"
            raise ToolArgumentsError(
                f"invalid arguments for tool {self.name!r}: {where}: {problems[0].message}"
            )
        return args


def arguments_model() -> type[pydantic.BaseModel]:
    """The pydantic model a ``Tool`` needs; an MCP tool validates by its JSON schema instead."""
    return _ANY_ARGUMENTS
