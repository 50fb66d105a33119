"""Proveedor real: una inferencia ya pagada no se paga otra vez, con un proveedor de verdad.

The agent talks to an OpenAI-compatible endpoint through ``OpenAIGateway`` (the
official ``openai`` SDK). Three passes over run-1, each in its own process,
twice: straight to the endpoint, and through ``asiento gateway`` (the
idempotency proxy, ``asiento.proxy.serve``) in front of it.

1. the child kills itself with SIGKILL right after m1's answer arrived and
   before the journal recorded it: the provider has been paid for it;
2. a new child resumes: m1 is asked again with the same idempotency key. The
   endpoint ignores keys, so straight to it m1 is generated and paid twice;
   through the proxy the stored answer comes back and nothing is paid;
3. a new child resumes the closed run: nothing is asked.

"Generations billed" counts the provider request ids first seen in a pass: a
replay by the proxy carries the id of the generation it replays. With the local
server the server's own count must agree.

    python examples/propiedades/08_proveedor_real.py        # a local scripted server
    ASIENTO_OPENAI_BASE_URL=https://api.openai.com/v1 ASIENTO_MODEL=gpt-4o-mini \\
        OPENAI_API_KEY=sk-... python examples/propiedades/08_proveedor_real.py
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from _medir import child, ending, lines, report, reported, table, tally, verdict

from asiento import Agent, FinalStep, ModelRequest, ModelResponse, Session, SqliteCheckpointer, tool
from asiento.gateways import OpenAIGateway

TAREA = "Lee el fichero /x con la herramienta read y dime en una frase qué contiene."
INSTRUCCIONES = "Usa las herramientas cuando haga falta. Responde en español."
ESPERADO = {"directo": (1, 2, 0), "asiento gateway": (1, 1, 0)}  # generations billed per pass
NOTAS = {
    ("directo", 2): "← m1 se paga otra vez",
    ("asiento gateway", 2): "← m1 lo contesta el proxy, sin pagar",
}


class Vigilante:
    """Logs each answer the gateway hands back (key and provider request id), fsynced.

    With ``morir`` the process dies with SIGKILL right after logging the first
    answer: paid for, and not yet recorded by the journal.
    """

    def __init__(self, inner: OpenAIGateway, log: Path, *, morir: bool) -> None:
        self.inner, self.log, self.morir = inner, log, morir

    async def complete(self, request: ModelRequest, *, idempotency_key: str) -> ModelResponse:
        response = await self.inner.complete(request, idempotency_key=idempotency_key)
        tally(self.log, f"answered {idempotency_key} {response.request_id}")
        if self.morir:
            os.kill(os.getpid(), signal.SIGKILL)
        return response


async def vuelta(db: Path, log: Path, base_url: str, model: str, *, morir: bool) -> None:
    """One pass, in this process: drive run-1 as far as it goes."""

    @tool(idempotent=True)
    def read(path: str) -> str:
        """Read a file and return its contents."""
        return "hola desde " + path

    agente = Agent(instructions=INSTRUCCIONES, tools=[read], max_turns=6)
    api_key = os.environ.get("ASIENTO_API_KEY") or os.environ.get("OPENAI_API_KEY") or "unused"
    store = SqliteCheckpointer(db)
    ended = "not closed"
    async with OpenAIGateway(model, base_url=base_url, api_key=api_key) as gateway:
        try:
            session = Session("run-1", Vigilante(gateway, log, morir=morir), store)
            async for paso in agente.run(TAREA, session=session):
                if isinstance(paso, FinalStep):
                    ended = "already closed" if paso.replayed else "closed"
        finally:
            await store.close()
    report({"ended": ended})


# -- a local OpenAI-compatible server, when no endpoint is given ---------------------------


class ServidorLocal:
    """Chat Completions on 127.0.0.1: turn 0 asks for read("/x"), turn 1 answers.

    Every answer is one billable generation with its own ``x-request-id``.
    """

    def __init__(self) -> None:
        self.generations = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self.generations += 1
            n = self.generations
        turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
        message: dict[str, Any] = {"role": "assistant", "content": "/x dice: hola"}
        if turn == 0:
            call = {"name": "read", "arguments": json.dumps({"path": "/x"})}
            calls = [{"id": f"call_{n}", "type": "function", "function": call}]
            message = {"role": "assistant", "content": None, "tool_calls": calls}
        usage = {"prompt_tokens": 20 * len(body["messages"]), "completion_tokens": 9}
        return {"id": f"chatcmpl-local-{n}", "object": "chat.completion", "model": body["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": usage | {"total_tokens": sum(usage.values())}}  # fmt: skip

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        servidor = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                out = json.dumps(servidor.answer(body)).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("x-request-id", f"req-local-{servidor.generations}")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler


def arrancar_proxy(upstream: str, db: Path) -> tuple[subprocess.Popen[str], str]:
    """``asiento gateway`` (``asiento.proxy.serve``) in its own process; the URL it prints."""
    code = "import sys; from asiento.proxy import serve; serve(sys.argv[1], db=sys.argv[2], port=0)"
    argv = [sys.executable, "-c", code, upstream, str(db)]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    ready, _, _ = select.select([proc.stderr], [], [], 60)
    line = proc.stderr.readline() if ready else ""
    if "asiento gateway: http://" not in line:
        proc.kill()
        raise SystemExit(f"the proxy did not start: {line or proc.communicate()[1]}")
    return proc, line.split()[2]


# -- the measurement -----------------------------------------------------------------------


def tres_vueltas(
    work: Path, base_url: str, model: str, local: ServidorLocal | None
) -> list[dict[str, Any]]:
    """Passes 1-3 on a fresh journal; what each one cost."""
    db, log = work / "runs.db", work / "model.log"
    seen: set[str] = set()
    rows = []
    for n in (1, 2, 3):
        before_lines, before_local = len(lines(log)), local.generations if local else 0
        argv = ["--vuelta", str(db), str(log), base_url, model, "morir" if n == 1 else "vivir"]
        proc = child(__file__, *argv)
        answers = [x.split() for x in lines(log)[before_lines:]]
        ids = {rid for _, _, rid in answers}
        rows.append({
            "pass": n, "answers": len(answers), "billed": len(ids - seen),
            "server": local.generations - before_local if local else None,
            "ended": (reported(proc) or {}).get("ended", ending(proc)),
            "keys": [key for _, key, _ in answers],
        })  # fmt: skip
        seen |= ids
    return rows


def medir(
    modo: str, upstream: str, model: str, local: ServidorLocal | None
) -> list[dict[str, Any]]:
    """The three passes straight to ``upstream``, or through a proxy started for them."""
    with tempfile.TemporaryDirectory() as tmp:
        if modo == "directo":
            return tres_vueltas(Path(tmp), upstream, model, local)
        proxy, base_url = arrancar_proxy(upstream, Path(tmp) / "keys.db")
        try:
            return tres_vueltas(Path(tmp), base_url, model, local)
        finally:
            proxy.terminate()
            proxy.communicate(timeout=30)


def fila(modo: str, r: dict[str, Any]) -> tuple[Any, ...]:
    nota = NOTAS.get((modo, r["pass"]), "")
    return (modo, r["pass"], r["answers"], r["billed"], r["ended"], nota)


def problemas(modo: str, rows: list[dict[str, Any]]) -> list[str]:
    out = []
    ended = [r["ended"] for r in rows]
    if ended != ["killed by SIGKILL", "closed", "already closed"]:
        out.append(f"{modo}: passes ended {ended}")
    billed = tuple(r["billed"] for r in rows)
    if modo == "asiento gateway" and billed[0] + billed[1] != len(set(rows[1]["keys"])):
        out.append(f"{modo}: the killed step was billed again ({billed})")
    if rows[2]["answers"] or rows[2]["billed"]:
        out.append(f"{modo}: the closed run asked the model again")
    for r in rows:
        if r["server"] is not None and r["server"] != r["billed"]:
            out.append(
                f"{modo} pass {r['pass']}: server counted {r['server']}, ids say {r['billed']}"
            )
    if rows[0]["server"] is not None and billed != ESPERADO[modo]:
        out.append(f"{modo}: generations billed {billed}, expected {ESPERADO[modo]}")
    return out


def main() -> int:
    if sys.argv[1:2] == ["--vuelta"]:
        db, log, base_url, model, fate = sys.argv[2:7]
        asyncio.run(vuelta(Path(db), Path(log), base_url, model, morir=fate == "morir"))
        return 0
    endpoint = os.environ.get("ASIENTO_OPENAI_BASE_URL")
    model = os.environ.get("ASIENTO_MODEL") or "modelo-local"
    local = None if endpoint else ServidorLocal()
    upstream = endpoint or (local.url if local else "")
    rows, problems = [], []
    try:
        for modo in ("directo", "asiento gateway"):
            medidas = medir(modo, upstream, model, local)
            problems += problemas(modo, medidas)
            rows += [fila(modo, r) for r in medidas]
    finally:
        if local is not None:
            local.close()
    where = endpoint or f"a local scripted server ({upstream})"
    headers = ["path", "pass", "answers received", "generations billed", "how it ended", "note"]
    table(f"run-1 against {where}, model {model}", headers, rows)
    return verdict(problems, "through asiento gateway, an answer already paid is not paid again")


if __name__ == "__main__":
    sys.exit(main())
