"""The echo backend: registered through meshgate's hooks, found through the ``meshgate`` entry point."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import meshgate

CARD = meshgate.ModelCard(
    name="echo:latest",
    path="",
    format="echo",
    family="echo",
    parameter_size="0",
    size=0,
    context_length=4096,
    source="meshgate-echo",
)


class EchoRunner:
    async def generate(self, request: meshgate.Request) -> AsyncIterator[meshgate.Event]:
        text = request.messages[-1].text if request.messages else (request.raw_prompt or "")
        words = text.split()
        limit = len(words) if request.max_tokens is None else min(len(words), request.max_tokens)
        yield meshgate.Usage(prompt_tokens=len(words))
        for i, word in enumerate(words[:limit]):
            yield meshgate.TextDelta(text=word if i == 0 else " " + word)
        yield meshgate.Usage(prompt_tokens=len(words), completion_tokens=limit)
        yield meshgate.Finished(reason="length" if limit < len(words) else "stop")

    async def count_tokens(self, request: meshgate.Request) -> int:
        return sum(len(m.text.split()) for m in request.messages)

    async def embed(self, request: meshgate.EmbedRequest) -> meshgate.Embeddings:
        raise meshgate.UnsupportedFeature("the echo backend does not compute embeddings")


class EchoBackend(meshgate.Backend):
    """Inherits ``context`` (the card's context length) and ``describe`` (what ``/api/show`` shows: the card's
    family and context) from ``meshgate.Backend``; a runtime that knows more about its models overrides them."""

    name = "echo"

    def supports(self, card: meshgate.ModelCard) -> bool:
        return card.format == "echo"

    def capabilities(self, card: meshgate.ModelCard) -> meshgate.Capabilities:
        return meshgate.Capabilities()

    def strategies(self, card: meshgate.ModelCard) -> frozenset[str]:
        return frozenset({"single"})

    def spec(self, card: meshgate.ModelCard) -> meshgate.ModelSpec:
        return meshgate.ModelSpec(
            name=card.name,
            n_layers=1,
            hidden_size=8,
            n_heads=1,
            n_kv_heads=1,
            head_dim=8,
            context_length=card.context_length,
            layer_bytes=1 << 20,
        )

    def costs(self, card: meshgate.ModelCard) -> meshgate.ShardCosts:
        return meshgate.ShardCosts()

    async def launch(
        self,
        card: meshgate.ModelCard,
        placement: meshgate.Candidate,
        shard: meshgate.Shard,
        *,
        host: str,
        peers: meshgate.Peers,
    ) -> meshgate.InProcess:
        return meshgate.InProcess()

    def connect(self, card: meshgate.ModelCard, placement: meshgate.Candidate, urls: Mapping[str, str]) -> EchoRunner:
        return EchoRunner()


class EchoSource:
    name = "echo"

    def models(self) -> list[meshgate.ModelCard]:
        return [CARD]


@meshgate.hookimpl
def meshgate_register_backends(register, settings, http) -> None:
    register(EchoBackend())


@meshgate.hookimpl
def meshgate_register_model_sources(register, settings) -> None:
    register(EchoSource())
