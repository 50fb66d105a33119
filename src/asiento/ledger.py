"""Prices: what a model call cost, recorded with the step that paid for it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .errors import UsageError
from .model import Usage


@dataclass(frozen=True, slots=True)
class Price:
    """Price of a model in your currency per million tokens, input and output."""

    input_per_mtok: float
    output_per_mtok: float

    def __post_init__(self) -> None:
        if self.input_per_mtok < 0 or self.output_per_mtok < 0:
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
    """What a call cost, or None when no price is known for its model."""
    price = price_for(model, prices) if prices else None
    if price is None:
        return None
    total = usage.input_tokens * price.input_per_mtok + usage.output_tokens * price.output_per_mtok
    return round(total / 1_000_000, 10)
