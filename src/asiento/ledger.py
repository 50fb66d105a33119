"""Prices: what a model call cost, recorded with the step that paid for it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .errors import UsageError
from .model import Usage


@dataclass(frozen=True, slots=True)
class Price:
    """Price of a model in your currency per million tokens: input, output and prompt caching.

    ``cached_input_per_mtok`` prices input tokens read from a prompt cache and
    ``cache_write_per_mtok`` those written to one (Anthropic's cache creation);
    left at None, they cost ``input_per_mtok`` like any other input token.
    """

    input_per_mtok: float
    output_per_mtok: float
    cached_input_per_mtok: float | None = None
    cache_write_per_mtok: float | None = None

    def __post_init__(self) -> None:
        prices = (self.input_per_mtok, self.output_per_mtok)
        optional = (self.cached_input_per_mtok, self.cache_write_per_mtok)
        if any(p < 0 for p in prices) or any(p is not None and p < 0 for p in optional):
            raise UsageError(f"a Price cannot be negative: {self}")


PriceTable = Mapping[str, Price]


def price_for(model: str, prices: PriceTable) -> Price | None:
    """The price of ``model``: its exact name, else the longest name it starts with.

    ``{"gpt-4o": ...}`` prices ``gpt-4o-2024-08-06`` too, as providers name dated snapshots.
    """
    if model in prices:
        return prices[model]
    matches = [name for name in prices if model.startswith(name)]
    return prices[max(matches, key=len)] if matches else None


def cost_of(usage: Usage, model: str, prices: PriceTable | None) -> float | None:
    """What a call cost, or None when no price is known for its model.

    Uncached input, cached input, cache writes and output each at their price.
    """
    price = price_for(model, prices) if prices else None
    if price is None:
        return None
    cached = _or(price.cached_input_per_mtok, price.input_per_mtok)
    written = _or(price.cache_write_per_mtok, price.input_per_mtok)
    total = (
        usage.uncached_input_tokens * price.input_per_mtok
        + usage.cached_input_tokens * cached
        + usage.cache_write_tokens * written
        + usage.output_tokens * price.output_per_mtok
    )
    return round(total / 1_000_000, 10)


def _or(price: float | None, default: float) -> float:
    return default if price is None else price
