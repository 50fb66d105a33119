"""What the SDK gateways share: closing the client they made, as async context managers."""

from __future__ import annotations

from types import TracebackType
from typing import Any, Self


class OwnedClient:
    """Closes ``self.client`` on ``aclose()`` when the gateway made it (not when it was given)."""

    client: Any
    _owned: bool

    async def aclose(self) -> None:
        """Close the SDK client if this gateway made it."""
        if self._owned:
            await self.client.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
