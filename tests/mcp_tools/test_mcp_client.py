"""The MCP client in this process: the annotation table, the schema, the key, reconnecting."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from asiento import (
    Agent,
    Decision,
    FinalStep,
    McpServerUnavailable,
    ModelResponse,
    Phase,
    Session,
    SqliteCheckpointer,
    StepEvent,
    ToolCall,
    UsageError,
    idem_key,
    require_approval_for_destructive,
    tool,
)
from asiento.mcp import UNTRUSTED, McpServer, McpTool, Treatment, treatment
from asiento.replay import tool_drift
from asiento.testing import ScriptedGateway

from .rig import RUN, SERVER, HttpServer, Rig

_RO, _DESTR, _IDEM = "readOnlyHint", "destructiveHint", "idempotentHint"


@pytest.mark.parametrize(
    ("annotations", "expected"),
    [
        ({_RO: True}, Treatment(idempotent=True, destructive=False)),
        ({_RO: True, _DESTR: True}, Treatment(idempotent=True, destructive=False)),
        ({_IDEM: True}, Treatment(idempotent=True, destructive=True)),
        ({_IDEM: True, _DESTR: False}, Treatment(idempotent=True, destructive=False)),
        ({_DESTR: False}, Treatment(idempotent=False, destructive=False)),
        ({}, Treatment(idempotent=False, destructive=True)),
        (None, Treatment(idempotent=False, destructive=True)),
        ({_RO: False, "openWorldHint": False}, Treatment(idempotent=False, destructive=True)),
    ],
)
def test_annotations_of_a_trusted_server_map_by_the_spec_defaults(
    annotations: dict[str, Any] | None, expected: Treatment
) -> None:
    """The table in docs/mcp.md, row by row, for a trusted server."""
    assert treatment(annotations, trusted=True) == expected


def test_an_untrusted_servers_annotations_are_ignored() -> None:
    """Untrusted: every tool is non-idempotent and destructive, whatever it says."""
    assert treatment({"readOnlyHint": True}, trusted=False) == UNTRUSTED
    assert Treatment(idempotent=False, destructive=True) == UNTRUSTED


def test_a_treatment_refuses_a_ttl_that_is_not_seconds() -> None:
    """A negative TTL is the caller's mistake, said at once."""
    with pytest.raises(UsageError, match="key_ttl"):
        Treatment(honours_keys=True, key_ttl=-1)


def test_a_server_takes_a_command_or_a_url() -> None:
    """Neither, both, or a command given as one string are refused."""
    with pytest.raises(UsageError, match="exactly one"):
        McpServer("x")
    with pytest.raises(UsageError, match="exactly one"):
        McpServer("x", command=["a"], url="http://127.0.0.1:1/mcp")
    with pytest.raises(UsageError, match="takes a list"):
        McpServer("x", command="python server.py")  # type: ignore[arg-type]


def _stdio(rig: Rig, **options: Any) -> McpServer:
    env = {k: v for k, v in rig.env().items() if k.startswith("MCP_") or k == "PYTHONPATH"}
    return McpServer("notes", command=[sys.executable, str(SERVER), "stdio"], env=env, **options)


async def _drive(agent: Agent, calls: list[ToolCall], db: Path, run_id: str = RUN) -> list[Any]:
    gateway = ScriptedGateway([ModelResponse(tool_calls=calls), ModelResponse(text="done")])
    store = SqliteCheckpointer(db)
    try:
        return [s async for s in agent.run("notes", session=Session(run_id, gateway, store))]
    finally:
        await store.close()


async def _events(db: Path) -> list[StepEvent]:
    store = SqliteCheckpointer(db)
    try:
        return await store.load(RUN)
    finally:
        await store.close()


async def test_tools_carry_the_servers_schema_and_treatment(rig: Rig) -> None:
    """Listed tools are McpTools with the server's JSON schema; explicit treatments win,
    and a treatment for a tool the server does not list is refused."""
    override = Treatment(idempotent=True, destructive=False)
    async with _stdio(rig, trusted=True, treatments={"send_note": override}) as server:
        tools = {t.name: t for t in await server.tools()}
        assert set(tools) == {"lookup", "whoami", "send_note", "delete_note", "transfer"}
        lookup = tools["lookup"]
        assert isinstance(lookup, McpTool)
        assert lookup.schema.parameters["required"] == ["city"]
        assert (lookup.idempotent, lookup.destructive) == (True, False)
        assert (tools["send_note"].idempotent, tools["send_note"].destructive) == (True, False)
        assert tools["delete_note"].destructive
    async with _stdio(rig, treatments={"nope": override}) as server:
        with pytest.raises(UsageError, match="does not list"):
            await server.tools()


async def test_key_in_meta_is_the_steps_idempotency_key(rig: Rig) -> None:
    """The server receives idem_key(run_id, step_id, arguments) in the call's _meta."""
    async with _stdio(rig, trusted=True) as server:
        agent = Agent(tools=await server.tools())
        await _drive(agent, [ToolCall(name="lookup", arguments={"city": "Lima"})], rig.db)
    (line,) = rig.ledger()
    assert line.split(" ")[1] == idem_key(RUN, "m1.t1", {"city": "Lima"})


async def test_arguments_that_do_not_fit_the_schema_never_reach_the_server(rig: Rig) -> None:
    """Arguments against the server's schema are the step's recorded failure; no call."""
    async with _stdio(rig, trusted=True) as server:
        agent = Agent(tools=await server.tools())
        steps = await _drive(agent, [ToolCall(name="lookup", arguments={"town": 1})], rig.db)
    assert isinstance(steps[-1], FinalStep)
    (result,) = [
        e for e in await _events(rig.db) if e.step_id == "m1.t1" and e.phase is Phase.RESULT
    ]
    assert result.payload["status"] == "error"
    assert "invalid arguments for tool 'lookup'" in result.payload["error"]
    assert rig.ledger() == []


async def test_results_are_recorded_like_any_tool_result(rig: Rig) -> None:
    """Structured content, plain text and isError are the steps' recorded outcomes, and
    local tools run beside the server's."""

    @tool
    def local(x: int) -> int:
        """Double it."""
        return 2 * x

    async with _stdio(rig, trusted=True) as server:
        agent = Agent(tools=[*await server.tools(), local])
        calls = [
            ToolCall(name="lookup", arguments={"city": "Lima"}),
            ToolCall(name="transfer", arguments={"amount": 3}),
            ToolCall(name="transfer", arguments={"amount": "many"}),
            ToolCall(name="local", arguments={"x": 4}),
        ]
        await _drive(agent, calls, rig.db)
    results = {e.step_id: e.payload for e in await _events(rig.db) if e.phase is Phase.RESULT}
    assert results["m1.t1"]["value"] == {"result": "sunny in Lima"}
    assert results["m1.t1"]["via"] == "publish"
    assert results["m1.t2"]["value"] == "moved 3"
    assert results["m1.t3"]["status"] == "error"  # refused by our check of the schema
    assert results["m1.t4"]["value"] == 8


async def test_a_run_of_local_tools_records_what_it_always_did(tmp_path: Path) -> None:
    """Only a run with tools from elsewhere records tool digests with m1: a run of local
    tools keeps its records and its fingerprint byte for byte."""

    @tool
    def local(x: int) -> int:
        """Double it."""
        return 2 * x

    agent = Agent(tools=[local])
    assert "sources" not in agent.head
    await _drive(agent, [ToolCall(name="local", arguments={"x": 1})], tmp_path / "runs.db")
    store = SqliteCheckpointer(tmp_path / "runs.db")
    try:
        (m1,) = [e for e in await store.load(RUN) if e.step_id == "m1"]
    finally:
        await store.close()
    assert "tools" not in m1.payload


async def test_a_server_that_died_between_calls_is_started_again(rig: Rig) -> None:
    """The stdio server dies between two runs' calls: the next call starts it again
    (nothing was sent to the dead one) and the call is made once."""
    async with _stdio(rig, trusted=True) as server:
        agent = Agent(tools=await server.tools())
        await _drive(agent, [ToolCall(name="whoami")], rig.db)
        (pid,) = [
            e.payload["value"]["result"]
            for e in await _events(rig.db)
            if e.step_id == "m1.t1" and e.phase is Phase.RESULT
        ]
        os.kill(pid, signal.SIGKILL)
        call = ToolCall(name="lookup", arguments={"city": "Lima"})
        steps = await _drive(agent, [call], rig.db, run_id="run-2")
    assert isinstance(steps[-1], FinalStep)
    assert len(rig.ledger()) == 1


async def test_a_server_down_before_a_call_records_that_it_did_not_happen(
    rig: Rig, http_server: HttpServer
) -> None:
    """Down when a call is due: McpServerUnavailable, the step is recorded as not having
    happened (never uncertain), and the resumed run calls it once."""
    http_server.start()
    assert rig.url is not None
    async with McpServer("notes", url=rig.url, trusted=True, connect_timeout=5) as server:
        agent = Agent(tools=await server.tools())
        http_server.kill()
        calls = [ToolCall(name="send_note", arguments={"text": "hola"})]
        with pytest.raises(McpServerUnavailable, match="Nothing was sent"):
            await _drive(agent, calls, rig.db)
        phases = [(e.step_id, e.phase) for e in await _events(rig.db)]
        assert ("m1.t1", Phase.RESOLUTION) in phases
        assert rig.ledger() == []
        http_server.start()
        steps = await _drive(agent, calls, rig.db)
    assert isinstance(steps[-1], FinalStep)
    assert len(rig.ledger()) == 1


def test_asiento_mcp_without_the_extra_names_it() -> None:
    """Without the mcp SDK, `import asiento` works and `import asiento.mcp` says
    `pip install 'asiento[mcp]'`."""
    probe = (
        "import sys\n"
        "class _NoMcp:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'mcp':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, _NoMcp())\n"
        "import asiento\n"
        "try:\n"
        "    import asiento.mcp\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(exc.name, '|', exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    name, _, message = done.stdout.strip().partition(" | ")
    assert name == "mcp"
    assert "pip install 'asiento[mcp]'" in message


def test_drift_names_the_tools_gone_new_and_changed() -> None:
    """The divergence detail names each tool by what happened to it; nothing when equal."""
    recorded = {"a": "1", "b": "2", "c": "3"}
    detail = tool_drift(recorded, {"a": "1", "b": "9", "d": "4"})
    assert detail is not None
    assert "no longer offered: 'c'" in detail
    assert "new: 'd'" in detail
    assert "changed (schema, description, annotations or treatment): 'b'" in detail
    assert "'a'" not in detail
    assert tool_drift(recorded, dict(recorded)) is None


def test_destructive_policy_asks_only_for_destructive_tools() -> None:
    """require_approval_for_destructive asks for an MCP tool treated as destructive, and
    allows a read-only one and every local tool."""

    @tool
    def local(x: int) -> int:
        """Double it."""
        return 2 * x

    def mcp_tool(name: str, treated: Treatment) -> McpTool:
        return McpTool(
            name=name, description="", idempotent=treated.idempotent, fn=local.fn,
            arguments_model=local.arguments_model, treatment=treated,
        )  # fmt: skip

    tools = [local, mcp_tool("rm", UNTRUSTED), mcp_tool("ls", treatment({_RO: True}, trusted=True))]
    policy = require_approval_for_destructive(tools)
    decisions = {t.name: policy(ToolCall(name=t.name)) for t in tools}
    assert decisions == {
        "local": Decision.ALLOW,
        "rm": Decision.REQUIRE_APPROVAL,
        "ls": Decision.ALLOW,
    }


def test_both_ends_spell_the_protocol_the_same() -> None:
    """The client's names (asiento.mcp) are the server helper's (asiento.mcp.server)."""
    from asiento import mcp
    from asiento.mcp import server

    assert mcp.IDEMPOTENCY_KEY == server.KEY_META == "asiento/idempotency-key"
    assert mcp.OUTCOME == server.OUTCOME_META == "asiento/outcome"
    assert (mcp.IN_PROGRESS, mcp.UNKNOWN, mcp.CONFLICT) == (
        server.IN_PROGRESS,
        server.UNKNOWN,
        server.CONFLICT,
    )


async def test_a_key_the_server_saw_with_other_arguments_is_a_conflict(rig: Rig) -> None:
    """A server (IdempotencyKeys) that saw the key with other arguments answers
    "conflict": IdempotencyKeyConflict, never an outcome, and nothing runs twice."""
    from asiento.effects import IdempotencyKeyConflict
    from asiento.payloads import Intent

    async with _stdio(rig, trusted=True) as server:
        transfer = {t.name: t for t in await server.tools()}["transfer"]
        first = Intent(tool="transfer", args={"amount": 1}, fp="-", idem_key="run-x:m1.t1:aaaaaa")
        done = await transfer.runner.execute(transfer, first, None, via="publish", attempts=1)
        assert done.value == "moved 1"
        other = Intent(tool="transfer", args={"amount": 2}, fp="-", idem_key=first.idem_key)
        with pytest.raises(IdempotencyKeyConflict, match="other arguments"):
            await transfer.runner.execute(transfer, other, None, via="publish", attempts=1)
    assert len(rig.ledger()) == 1


async def test_a_result_that_is_not_mcp_is_an_asiento_error_and_the_step_stays_submitted(
    rig: Rig,
) -> None:
    """A hostile server applies the call, then answers a result no client can read: the
    pass raises ToolAnswerLost naming server and tool (not pydantic's ValidationError),
    nothing is recorded as the outcome, and the resume follows the replay table: the
    note, not idempotent, is uncertain; it was sent once."""
    from asiento import ToolAnswerLost, UncertainEffect

    env = {k: v for k, v in rig.env().items() if k.startswith("MCP_") or k == "PYTHONPATH"}
    env["MCP_MALFORMED"] = "send_note"
    hostile = McpServer("notes", command=[sys.executable, str(SERVER), "stdio"], env=env)
    call = [ToolCall(name="send_note", arguments={"text": "hi"})]
    async with hostile as server:
        agent = Agent(tools=await server.tools())
        with pytest.raises(ToolAnswerLost) as lost:
            await _drive(agent, call, rig.db)
        assert "MCP server 'notes'" in str(lost.value)
        assert "tool 'send_note'" in str(lost.value)
        assert "validation error" in str(lost.value)
        assert isinstance(lost.value.__cause__, ValueError)  # pydantic's, kept as the cause
        phases = [e.phase for e in await _events(rig.db) if e.step_id.startswith("m1.t1")]
        assert phases == [Phase.INTENT, Phase.SUBMITTED]
        with pytest.raises(UncertainEffect):
            await _drive(agent, call, rig.db)
    assert len(rig.ledger()) == 1
