"""The echo backend: registered through meshgate's hooks, found through the ``meshgate`` entry point."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

from backends.base import Capabilities, InProcess, ModelCard, Peers
from backends.placement import Candidate, ModelSpec, Shard, ShardCosts
from plugins.hookspecs import hookimpl
from protocols.model import EmbedRequest, Embeddings, Event, Finished, Request, TextDelta, Usage, UnsupportedFeature

CARD = ModelCard(name="echo:latest", path="", format="echo", family="echo", parameter_size="0", size=0,
                 context_length=4096, source="meshgate-echo")


class EchoRunner:
    async def generate(self, request: Request) -> AsyncIterator[Event]:
        text = request.messages[-1].text if request.messages else (request.raw_prompt or "")
        words = text.split()
        limit = len(words) if request.max_tokens is None else min(len(words), request.max_tokens)
        yield Usage(prompt_tokens=len(words))
        for i, word in enumerate(words[:limit]):
            yield TextDelta(text=word if i == 0 else " " + word)
        yield Usage(prompt_tokens=len(words), completion_tokens=limit)
        yield Finished(reason="length" if limit < len(words) else "stop")

    async def count_tokens(self, request: Request) -> int:
        return sum(len(m.text.split()) for m in request.messages)

    async def embed(self, request: EmbedRequest) -> Embeddings:
        raise UnsupportedFeature("the echo backend does not compute embeddings")


class EchoBackend:
    name = "echo"

    def supports(self, card: ModelCard) -> bool:
        return card.format == "echo"

    def capabilities(self, card: ModelCard) -> Capabilities:
        return Capabilities()

    def strategies(self, card: ModelCard) -> frozenset[str]:
        return frozenset({"single"})

    def spec(self, card: ModelCard) -> ModelSpec:
        return ModelSpec(name=card.name, n_layers=1, hidden_size=8, n_heads=1, n_kv_heads=1, head_dim=8,
                         context_length=card.context_length, layer_bytes=1 << 20)

    def costs(self, card: ModelCard) -> ShardCosts:
        return ShardCosts()

    async def launch(self, card: ModelCard, placement: Candidate, shard: Shard, *, host: str,
                     peers: Peers) -> InProcess:
        return InProcess()

    def connect(self, card: ModelCard, placement: Candidate, urls: Mapping[str, str]) -> EchoRunner:
        return EchoRunner()


class EchoSource:
    name = "echo"

    def models(self) -> list[ModelCard]:
        return [CARD]


@hookimpl
def meshgate_register_backends(register, settings, http) -> None:
    register(EchoBackend())


@hookimpl
def meshgate_register_model_sources(register, settings) -> None:
    register(EchoSource())
