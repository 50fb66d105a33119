"""What the MCP crash tests share: the agent child, the server's ledger, its HTTP process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
CHILD = HERE / "child.py"
SERVER = HERE / "server.py"
RUN = "run-1"
KILLED = -signal.SIGKILL
WAIT_STEPS, WAIT_STEP = 1500, 0.02  # at most 30 s for anything the tests wait for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Rig:
    """One run against one MCP server: the children that drive it and what the server did."""

    tmp: Path
    url: str | None = None  # None: the child starts the server over stdio
    hold: str | None = None
    variant: str | None = None
    flags: tuple[str, ...] = ()
    ends: list[str] = field(default_factory=list)

    @property
    def db(self) -> Path:
        return self.tmp / "runs.db"

    @property
    def ledger_path(self) -> Path:
        return self.tmp / "ledger"

    @property
    def gate(self) -> Path:
        return self.tmp / "gate"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MCP_", "ASIENTO_CRASH"))}
        env |= {
            "MCP_LEDGER": str(self.ledger_path),
            "MCP_GATE": str(self.gate),
            "MCP_DEDUP": str(self.tmp / "dedup.db"),
        }
        if self.hold:
            env["MCP_HOLD"] = self.hold
        if self.variant:
            env["MCP_VARIANT"] = self.variant
        return env

    def argv(self, tool: str, args: dict[str, Any]) -> list[str]:
        where = ["--url", self.url] if self.url else ["--stdio"]
        return [
            sys.executable, str(CHILD), "--db", str(self.db), "--run", RUN,
            "--tool", tool, "--args", json.dumps(args), *where, *self.flags,
        ]  # fmt: skip

    def start(self, tool: str, args: dict[str, Any]) -> subprocess.Popen[str]:
        """A child driving the run, left running (to be killed)."""
        return subprocess.Popen(
            self.argv(tool, args),
            env=self.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def run(self, tool: str, args: dict[str, Any]) -> dict[str, Any]:
        """A child driving the run as far as it goes: how it ended."""
        proc = self.start(tool, args)
        return self.ended(proc)

    def ended(self, proc: subprocess.Popen[str]) -> dict[str, Any]:
        out, err = proc.communicate(timeout=60)
        if proc.returncode == KILLED:
            ended: dict[str, Any] = {"ended": "killed"}
        else:
            lines = out.strip().splitlines()
            assert lines, f"exit {proc.returncode}, no output; stderr:\n{err[-3000:]}"
            ended = json.loads(lines[-1])
        self.ends.append(ended["ended"])
        return ended

    def kill_inside(self, proc: subprocess.Popen[str], calls: int = 1) -> None:
        """SIGKILL the child once the server applied ``calls`` calls (it holds the last)."""
        self.wait_for_ledger(calls)
        proc.kill()
        self.ended(proc)

    def wait_for_ledger(self, calls: int) -> None:
        for _ in range(WAIT_STEPS):
            if len(self.ledger()) >= calls:
                return
            time.sleep(WAIT_STEP)
        raise AssertionError(f"the server never applied {calls} call(s): {self.ledger()}")

    def release(self) -> None:
        """Open the gate: a held call goes on, and no later call is held."""
        self.gate.touch()

    def ledger(self) -> list[str]:
        """What the server applied, one line a call: ``tool key arguments``."""
        if not self.ledger_path.exists():
            return []
        return self.ledger_path.read_text().splitlines()


class HttpServer:
    """``server.py http PORT`` in a process of its own, which the tests may kill."""

    def __init__(self, rig: Rig) -> None:
        self.rig, self.port = rig, free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        rig.url = f"http://127.0.0.1:{self.port}/mcp"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(SERVER), "http", str(self.port)],
            env=self.rig.env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(WAIT_STEPS):
            assert self.proc.poll() is None, "the MCP server exited at start"
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(WAIT_STEP)
        raise AssertionError("the MCP server never listened")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
