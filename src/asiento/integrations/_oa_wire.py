"""The OpenAI Agents SDK's objects as JSON, and back: what a model step records of them.

A model step records the SDK's ``ModelResponse`` with the SDK's own pydantic
models (output items, usage), so a replayed answer is the very objects the SDK
built from the provider's answer. Beside it, the step records asiento's summary
(text, tool calls, usage) so ``asiento ls`` / ``show`` read it like a native step.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import pydantic
from agents import Handoff, ModelSettings, Tool
from agents.agent_output import AgentOutputSchemaBase
from agents.items import ModelResponse as SdkResponse
from agents.items import TResponseOutputItem
from agents.tool import FunctionTool
from agents.usage import Usage as SdkUsage
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from .._canonical import fingerprint
from ..model import ModelResponse, ToolCall, Usage

_ITEMS: pydantic.TypeAdapter[list[TResponseOutputItem]] = pydantic.TypeAdapter(
    list[TResponseOutputItem]
)
_USAGE: pydantic.TypeAdapter[SdkUsage] = pydantic.TypeAdapter(SdkUsage)

# The key of a model step's payload that holds the SDK's own response.
RESPONSE_KEY = "openai_agents"


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON: pydantic models and dataclasses dumped, the rest as JSON has it.

    What is not JSON at all becomes its ``str``, so a recorded value always reads back.
    """
    if isinstance(value, pydantic.BaseModel):
        return value.model_dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return json.loads(json.dumps(dataclasses.asdict(value), default=_default))
    return json.loads(json.dumps(value, default=_default))


def _default(value: Any) -> Any:
    if isinstance(value, pydantic.BaseModel):
        return value.model_dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return str(value)


def dump_response(response: SdkResponse) -> dict[str, Any]:
    """The SDK's response as JSON, with its own models' serialisation.

    An output item keeps only the fields that were set on it, under their wire names
    (``async``, not ``async_``): loaded back, it is the very object the SDK built, unset
    fields unset. The SDK turns an answer into the next request's input with
    ``model_dump(exclude_unset=True)``, so an item read back with every field set (an
    explicit ``caller: None``, ``namespace: None``...) would make the replayed pass send
    another conversation than the recorded one, and the next step diverge.
    """
    return {
        "output": _ITEMS.dump_python(
            list(response.output), mode="json", by_alias=True, exclude_unset=True
        ),
        "usage": _USAGE.dump_python(response.usage, mode="json"),
        "response_id": response.response_id,
        "request_id": response.request_id,
    }


def load_response(data: Any) -> SdkResponse:
    """A recorded response back to the SDK's objects."""
    return SdkResponse(
        output=_ITEMS.validate_python(data["output"]),
        usage=_USAGE.validate_python(data["usage"]),
        response_id=data.get("response_id"),
        request_id=data.get("request_id"),
    )


def summary(response: SdkResponse, model: str) -> ModelResponse:
    """asiento's view of the answer: its text, its function calls in order, its usage."""
    texts = [
        part.text
        for item in response.output
        if isinstance(item, ResponseOutputMessage)
        for part in item.content
        if isinstance(part, ResponseOutputText)
    ]
    usage = Usage(
        input_tokens=response.usage.input_tokens,
        output_tokens=response.usage.output_tokens,
        cached_input_tokens=response.usage.input_tokens_details.cached_tokens or 0,
    )
    return ModelResponse(
        text="".join(texts),
        tool_calls=[_call(c) for c in function_calls(response)],
        usage=usage,
        model=model,
        request_id=response.request_id,
    )


def function_calls(response: SdkResponse) -> list[ResponseFunctionToolCall]:
    """The function calls (tools and handoffs) of an answer, in the order the model wrote them."""
    return [item for item in response.output if isinstance(item, ResponseFunctionToolCall)]


def _call(call: ResponseFunctionToolCall) -> ToolCall:
    try:
        arguments = json.loads(call.arguments or "{}")
    except ValueError:
        return ToolCall(name=call.name, id=call.call_id, raw_arguments=call.arguments)
    if not isinstance(arguments, dict):
        return ToolCall(name=call.name, id=call.call_id, raw_arguments=call.arguments)
    return ToolCall(name=call.name, arguments=arguments, id=call.call_id)


def request_fingerprint(
    *,
    system_instructions: str | None,
    input: Any,
    model_settings: ModelSettings,
    tools: Sequence[Tool],
    output_schema: AgentOutputSchemaBase | None,
    handoffs: Sequence[Handoff[Any, Any]],
) -> str:
    """What the SDK asks the model, hashed: instructions, conversation, settings, tools,
    output schema and handoffs. A resumed run that would ask something else diverges."""
    settings = {k: v for k, v in model_settings.to_json_dict().items() if k != "extra_headers"}
    return fingerprint(
        [
            system_instructions,
            jsonable(input),
            settings,
            [_tool_shape(t) for t in tools],
            None if output_schema is None else jsonable(output_schema.json_schema()),
            [[h.tool_name, jsonable(h.input_json_schema)] for h in handoffs],
        ]
    )[:32]


def _tool_shape(tool: Tool) -> Any:
    if isinstance(tool, FunctionTool):
        return [tool.name, tool.description, jsonable(tool.params_json_schema)]
    return [type(tool).__name__, getattr(tool, "name", "")]
