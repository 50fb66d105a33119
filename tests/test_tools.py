"""``@tool``: schemas from type hints and docstrings, argument checks, declaration forms."""

from __future__ import annotations

import asyncio
import contextvars
import os
import select
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import pydantic
import pytest

from asiento import Tool, UsageError, tool
from asiento.tools import ToolArgumentsError


@tool
def add(a: int, b: int = 2) -> int:
    """Add two integers.

    Longer explanation the model does not need.

    Args:
        a: the first addend.
        b (int): the second addend.

    Returns:
        The sum.
    """
    return a + b


class Address(pydantic.BaseModel):
    city: str
    zip: str | None = None


@tool
def ship(to: Address, speed: Literal["slow", "fast"], items: list[int]) -> str:
    """Ship some items."""
    return f"{to.city}:{speed}:{sum(items)}"


def params(t: Tool) -> dict[str, Any]:
    return dict(t.schema.parameters)


def test_schema_from_hints_and_docstring() -> None:
    """Name, summary, types and the Args descriptions land in the schema."""
    schema = add.schema
    assert (schema.name, schema.description) == ("add", "Add two integers.")
    props = params(add)["properties"]
    assert props["a"]["type"] == "integer"
    assert props["a"]["description"] == "the first addend."
    assert props["b"]["description"] == "the second addend."
    assert params(add)["type"] == "object"


def test_multiline_arg_description_is_kept_whole() -> None:
    """A Google-style Args entry continued on the next line keeps its whole text."""

    @tool
    def fetch(url: str) -> str:
        """Fetch a page.

        Args:
            url: the address to fetch,
                including the scheme.
        """
        return url

    assert params(fetch)["properties"]["url"]["description"] == (
        "the address to fetch, including the scheme."
    )


def test_defaults_make_fields_optional() -> None:
    """A parameter with a default is optional; one without is required."""
    assert params(add)["required"] == ["a"]
    assert params(add)["properties"]["b"]["default"] == 2
    assert add.validate({"a": 1}) == {"a": 1, "b": 2}


def test_extra_arguments_are_rejected() -> None:
    """An argument the function does not take is refused, and the schema says so."""
    assert params(add)["additionalProperties"] is False
    with pytest.raises(ToolArgumentsError, match="'add'"):
        add.validate({"a": 1, "c": 3})


@pytest.mark.parametrize("arguments", [{"a": "not a number"}, {"a": [1]}, {}, {"b": 1}])
def test_wrong_arguments_name_the_tool(arguments: dict[str, Any]) -> None:
    """Arguments of the wrong type, or missing, raise ToolArgumentsError naming the tool."""
    with pytest.raises(ToolArgumentsError, match="'add'"):
        add.validate(arguments)


async def test_invalid_arguments_never_reach_the_function() -> None:
    """invoke() validates first: the function does not run on bad arguments."""
    calls: list[int] = []

    @tool
    def record(n: int) -> int:
        calls.append(n)
        return n

    with pytest.raises(ToolArgumentsError):
        await record.invoke({"n": "many"})
    assert calls == []


def test_var_args_are_refused() -> None:
    """*args and **kwargs cannot be described to a model: UsageError."""

    def star(*items: int) -> None: ...

    def double_star(**options: str) -> None: ...

    for fn in (star, double_star):
        with pytest.raises(UsageError, match=fn.__name__):
            tool(fn)


@pytest.mark.parametrize("bad", ["has space", "dot.ted", "x" * 65, "ñandú", "a/b", "<lambda>"])
def test_bad_tool_names_are_refused(bad: str) -> None:
    """Names outside 1-64 letters, digits, _ and - are a UsageError."""
    with pytest.raises(UsageError, match="tool name"):
        tool(name=bad)(lambda x: x)


def test_lambda_needs_a_name() -> None:
    """A lambda has no usable name unless one is given."""
    with pytest.raises(UsageError):
        tool(lambda x: x)
    assert tool(name="echo")(lambda x: x).name == "echo"


def test_good_names_are_accepted() -> None:
    """A 64-character name with digits, _ and - is fine."""
    name = "a-b_C9" + "x" * 58
    assert tool(name=name)(add.fn).name == name


def test_decorator_forms() -> None:
    """@tool, @tool() and @tool(idempotent=True) all make a Tool."""

    @tool
    def bare() -> None: ...

    @tool()
    def called() -> None: ...

    @tool(idempotent=True, name="lookup", description="Look it up.")
    def safe() -> None: ...

    assert all(isinstance(t, Tool) for t in (bare, called, safe))
    assert (bare.name, called.name, safe.name) == ("bare", "called", "lookup")
    assert safe.description == "Look it up."
    assert (bare.idempotent, called.idempotent, safe.idempotent) == (False, False, True)


def test_non_idempotent_by_default() -> None:
    """A tool is not idempotent unless it says so."""
    assert add.idempotent is False


def test_idempotent_must_be_a_bool() -> None:
    """@tool(idempotent=...) takes True or False only."""
    with pytest.raises(UsageError, match="idempotent"):
        tool(idempotent="yes")(add.fn)  # type: ignore[arg-type]


async def test_sync_and_async_tools_are_invoked() -> None:
    """invoke() runs sync functions and awaits async ones, with validated arguments."""

    @tool
    async def slow_add(a: int, b: int) -> int:
        return a + b

    assert await add.invoke({"a": 40}) == 42
    assert await slow_add.invoke({"a": 1, "b": 2}) == 3
    assert add(1, 1) == 2


def test_rich_parameter_schemas() -> None:
    """Pydantic models, Literal and list[int] parameters get precise schemas."""
    schema = params(ship)
    props = schema["properties"]
    assert props["speed"]["enum"] == ["slow", "fast"]
    assert (props["items"]["type"], props["items"]["items"]) == ("array", {"type": "integer"})
    ref = props["to"]["$ref"].rsplit("/", 1)[-1]
    address = schema["$defs"][ref]
    assert address["required"] == ["city"]
    assert set(address["properties"]) == {"city", "zip"}
    assert sorted(schema["required"]) == ["items", "speed", "to"]


async def test_rich_parameters_are_validated_and_converted() -> None:
    """JSON arguments become the model instance, and bad literals are refused."""
    assert await ship.invoke({"to": {"city": "Lima"}, "speed": "fast", "items": [1, 2]}) == (
        "Lima:fast:3"
    )
    with pytest.raises(ToolArgumentsError, match="'ship'"):
        ship.validate({"to": {"city": "Lima"}, "speed": "warp", "items": []})
    with pytest.raises(ToolArgumentsError, match="'ship'"):
        ship.validate({"to": {}, "speed": "slow", "items": []})


def test_common_parameter_names_are_accepted() -> None:
    """Parameters called schema, json or copy make a tool without warnings."""

    @tool
    def query(sql: str, schema: str = "public", json: bool = False) -> str:
        return f"{schema}:{sql}:{json}"

    assert set(params(query)["properties"]) == {"sql", "schema", "json"}
    assert query.validate({"sql": "select 1", "schema": "s"})["schema"] == "s"


# -- where sync tools run --------------------------------------------------------------


async def test_a_slow_sync_tool_leaves_the_event_loop_free() -> None:
    """A sync tool that blocks runs off the loop: other tasks (the lease renewal) go on."""
    ticks: list[float] = []

    @tool
    def slow() -> str:
        time.sleep(0.3)
        return threading.current_thread().name

    async def ticker() -> None:
        for _ in range(100):
            ticks.append(time.monotonic())
            await asyncio.sleep(0.01)

    running = asyncio.create_task(ticker())
    started = time.monotonic()
    name = await slow.invoke({})
    running.cancel()
    assert name != threading.current_thread().name
    during = [t for t in ticks if started + 0.05 < t < started + 0.25]
    assert len(during) >= 5, f"the loop ran {len(during)} times in 0.2 s of a blocking tool"


async def test_a_quick_sync_tool_runs_off_the_loop_thread_too() -> None:
    """However quick, a sync tool runs on another thread, not on the loop's."""

    @tool
    def where() -> str:
        return threading.current_thread().name

    names = {await where.invoke({}) for _ in range(20)}
    assert threading.current_thread().name not in names


async def test_sync_tools_run_on_asientos_tool_threads() -> None:
    """Not on the loop's default executor, whose futures cannot be waited for directly."""

    @tool
    def where(seconds: float) -> str:
        time.sleep(seconds)
        return threading.current_thread().name

    loop = asyncio.get_running_loop()
    chosen = ThreadPoolExecutor(max_workers=1, thread_name_prefix="the-apps-own")
    loop.set_default_executor(chosen)
    try:
        quick, slow = await where.invoke({"seconds": 0}), await where.invoke({"seconds": 0.05})
    finally:
        chosen.shutdown(wait=True)
    assert quick.startswith("asiento-tool")
    assert slow.startswith("asiento-tool")


async def test_sync_tools_see_the_callers_context_variables() -> None:
    """The step's context (``current_step()``) is visible in a sync tool's thread."""
    seen: contextvars.ContextVar[str] = contextvars.ContextVar("seen", default="unset")

    @tool
    def read() -> str:
        return seen.get()

    @tool
    def read_slowly() -> str:
        time.sleep(0.05)  # past the quick wait: delivered through the event loop
        return seen.get()

    token = seen.set("the caller's")
    try:
        assert await read.invoke({}) == "the caller's"
        assert await read_slowly.invoke({}) == "the caller's"
    finally:
        seen.reset(token)


@pytest.mark.parametrize("delay", [0.0, 0.05])
async def test_a_sync_tools_own_timeout_error_is_its_outcome(delay: float) -> None:
    """A TimeoutError the tool raises is the tool's, whether it came quickly or not."""

    @tool
    def times_out() -> str:
        time.sleep(delay)
        raise TimeoutError("the remote end took too long")

    with pytest.raises(TimeoutError, match="remote end"):
        await times_out.invoke({})


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_sync_tools_work_in_a_forked_child_of_a_process_that_used_them() -> None:
    """A forked child does not inherit the parent's tool threads; it starts its own."""

    @tool
    def double(n: int) -> int:
        return 2 * n

    assert asyncio.run(double.invoke({"n": 1})) == 2  # the parent's pool now has a thread
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a result, or silence if it hangs
        try:
            os.write(writer, str(asyncio.run(double.invoke({"n": 21}))).encode())
        finally:
            os._exit(0)
    os.close(writer)
    try:
        ready, _, _ = select.select([reader], [], [], 20)
        assert ready, "the forked child hung calling a sync tool"
        assert os.read(reader, 100) == b"42"
    finally:
        os.close(reader)
        if os.waitpid(pid, os.WNOHANG)[0] == 0:  # still running: it hung
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
