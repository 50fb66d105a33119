"""A streamed answer the proxy is reading from upstream, shared by every client of its key.

The proxy, not a client, reads the stream to its end: a client that goes away
stops receiving, not recording. A second request for the same key attaches: it
gets the events so far, then the rest as they come. Only a stream that reached
its API's last event is kept; one cut short is not an answer a run could record.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

from starlette.responses import Response, StreamingResponse

from ..errors import AsientoError

# The event that ends a complete stream, per API (Chat Completions, Responses, Messages).
_LAST_EVENT = {
    "/v1/chat/completions": (b"data: [DONE]",),
    "/v1/responses": (b"response.completed", b"response.incomplete"),
    "/v1/messages": (b"message_stop",),
}


class StreamCut(AsientoError):
    """Upstream's stream ended before its last event: the attached clients see it cut."""


class Recording:
    """The chunks of one upstream stream so far, and whether it ended whole."""

    def __init__(self, path: str, fingerprint: str) -> None:
        self.path, self.fingerprint = path, fingerprint
        self.chunks: list[bytes] = []
        self.ended = False
        self.cut = False
        self._head: asyncio.Future[Response | tuple[int, dict[str, str]]] = (
            asyncio.get_running_loop().create_future()
        )
        self._more = asyncio.Event()

    def answered(self, response: Response) -> None:
        """Upstream did not stream (an error, a plain answer): every client gets this."""
        self._head.set_result(response)
        self.end(cut=False)

    def failed(self, response: Response) -> None:
        """Reading upstream failed: clients not started get ``response``, the others a cut."""
        if not self._head.done():
            self._head.set_result(response)
        if not self.ended:
            self.end(cut=True)

    @property
    def streaming(self) -> bool:
        """Whether clients are being sent the stream (its status and headers are out)."""
        return self._head.done() and not isinstance(self._head.result(), Response)

    def started(self, status: int, headers: Mapping[str, str]) -> None:
        self._head.set_result((status, dict(headers)))

    def add(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self._wake()

    def end(self, *, cut: bool) -> None:
        self.ended, self.cut = True, cut
        self._wake()

    def whole(self) -> bytes | None:
        """The stream's bytes if it ended with its API's last event, else None."""
        body = b"".join(self.chunks)
        if self.cut or not any(last in body for last in _LAST_EVENT.get(self.path, ())):
            return None
        return body

    async def response(self, extra: Mapping[str, str]) -> Response:
        """What one client gets: the stream from its first chunk, live; or the plain answer."""
        head = await asyncio.shield(self._head)
        if isinstance(head, Response):
            return head
        status, headers = head
        return StreamingResponse(self._follow(), status, headers=headers | dict(extra))

    async def _follow(self) -> AsyncIterator[bytes]:
        sent = 0
        while True:
            more = self._more
            while sent < len(self.chunks):
                yield self.chunks[sent]
                sent += 1
            if self.ended:
                if self.cut:  # the client's connection is cut too, never ended as if whole
                    raise StreamCut(f"upstream's stream for {self.path} was cut")
                return
            await more.wait()

    def _wake(self) -> None:
        more, self._more = self._more, asyncio.Event()
        more.set()
