"""The models the model sources offer, by the names clients use for them.

Imports the backend contract and protocols only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from meshgate.backends.base import ModelCard, ModelSource
from meshgate.protocols.model import UnknownModel

__all__ = ["Catalog", "normalize_model_name"]

log = logging.getLogger("meshgate.catalog")


def normalize_model_name(name: str) -> str:
    """Ollama-style names: ``name:tag`` with ``latest`` implied."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


class Catalog:
    """The models the model sources offer, by name."""

    def __init__(self, sources: Sequence[ModelSource]) -> None:
        self.sources = list(sources)
        self._cards: dict[str, ModelCard] = {}

    def refresh(self) -> list[ModelCard]:
        """Ask every source for its models (blocking: a source may assemble files)."""
        cards: dict[str, ModelCard] = {}
        for source in self.sources:
            try:
                for card in source.models():
                    cards.setdefault(card.name, card)
            except Exception:
                log.exception("model source %r failed; its models are not listed", source.name)
        self._cards = cards
        return list(cards.values())

    def models(self) -> list[ModelCard]:
        return list(self._cards.values())

    def resolve(self, name: str) -> ModelCard:
        """The card for a client's model name; ``UnknownModel`` if none."""
        card = self._cards.get(name) or self._cards.get(normalize_model_name(name))
        if card is None and name.endswith(":latest"):
            card = self._cards.get(name.removesuffix(":latest"))
        if card is None:
            raise UnknownModel(name)
        return card
