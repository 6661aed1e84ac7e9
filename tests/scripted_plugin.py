"""A scripted backend for exact wire-format tests, registered as a plugin (``--plugin tests.scripted_plugin``).

Model ``scripted`` plays back a script chosen by the last user message's text (``SCRIPTS``); a conversation that
ends in a tool result is answered with which call the result answers (``result for <id> answers <call> <name>:
<content>``, or ``answers no call``), so tests see the ids meet inside the backend; ``sleep <seconds>``
answers ``slept`` after that long (a slow request, for queue tests); ``how long`` answers how many messages and
words (its token count) reached the backend; counts take turns on one core (a runner's CPU) and a prompt with
the word ``slowcount`` holds it a second; anything else is echoed back word by word. Its embeddings are
``scripted_vector`` of each input (4 dimensions, unit length, float32 values; ``prompt_tokens`` counts words, or
token ids). It never ships as a default: only tests load it.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import struct
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

import msgspec

from meshgate.backends.base import Backend, Capabilities, InProcess, ModelCard, ModelSource, Peers
from meshgate.backends.placement import Candidate, ModelSpec, Shard, ShardCosts
from meshgate.plugins.hookspecs import hookimpl
from meshgate.protocols.model import (
    Embeddings,
    EmbedRequest,
    ErrorInfo,
    Event,
    Failed,
    Finished,
    InvalidRequest,
    KeepAlive,
    ReasoningDelta,
    Request,
    TextDelta,
    TextPart,
    ToolCallDelta,
    ToolCallPart,
    ToolResultPart,
    Usage,
)

CARD = ModelCard(
    name="scripted",
    path="",
    format="scripted",
    family="script",
    parameter_size="0",
    size=1,
    digest="0" * 64,
    created=1_700_000_000.0,
    context_length=1024,
)

BIG = ModelCard(
    name="scripted-big:latest",
    path="",
    format="scripted",
    family="script",
    parameter_size="1B",
    size=2 << 30,
    digest="1" * 64,
    created=1_700_000_000.0,
    context_length=1024,
)
"""A 2 GiB model (16 x 128 MiB layers) that may be split into a pipeline: for placement tests."""

SLASHED = msgspec.structs.replace(CARD, name="acme/scripted:v1")
"""A model id with ``/`` and ``:`` (OAI-8: SDKs send it raw or percent-encoded)."""

HUGE = msgspec.structs.replace(BIG, name="scripted-huge:latest", size=64 << 30)
"""A 64 GiB model that fits on no test node."""

SCRIPTS: dict[str, list[Event]] = {
    "hello": [
        Usage(prompt_tokens=7),
        TextDelta(text="Hello"),
        TextDelta(text=", world"),
        Usage(prompt_tokens=7, completion_tokens=2),
        Finished(reason="stop"),
    ],
    "length": [
        Usage(prompt_tokens=3),
        TextDelta(text="cut"),
        Usage(prompt_tokens=3, completion_tokens=1),
        Finished(reason="length"),
    ],
    "stopseq": [
        Usage(prompt_tokens=3),
        TextDelta(text="one two"),
        Usage(prompt_tokens=3, completion_tokens=2),
        Finished(reason="stop_sequence", stop_sequence="three"),
    ],
    "tool": [
        Usage(prompt_tokens=11),
        ToolCallDelta(index=0, id="call_abc", name="get_weather", arguments='{"ci'),
        ToolCallDelta(index=0, arguments='ty": "Paris"}'),
        Usage(prompt_tokens=11, completion_tokens=9),
        Finished(reason="tool_calls"),
    ],
    "think": [
        Usage(prompt_tokens=4),
        ReasoningDelta(text="Let me see."),
        TextDelta(text="Yes."),
        Usage(prompt_tokens=4, completion_tokens=5),
        Finished(reason="stop"),
    ],
    "keepalive": [
        KeepAlive(),
        Usage(prompt_tokens=2),
        TextDelta(text="ok"),
        Usage(prompt_tokens=2, completion_tokens=1),
        Finished(reason="stop"),
    ],
    "fail": [
        Usage(prompt_tokens=5),
        TextDelta(text="partial"),
        Failed(error=ErrorInfo(kind="BackendUnavailable", message="runner lost")),
    ],
    "failfirst": [Failed(error=ErrorInfo(kind="NoCapacity", message="no node has room for this model"))],
    "unprocessable": [Failed(error=ErrorInfo(kind="Unprocessable", message="this schema cannot be enforced"))],
}


def _answer_tool_result(request: Request) -> list[Event]:
    """Which call the last tool result answers, by id, among the calls the conversation holds."""
    (result,) = [p for p in request.messages[-1].parts if isinstance(p, ToolResultPart)]
    calls = {p.id: p for m in request.messages for p in m.parts if isinstance(p, ToolCallPart)}
    call = calls.get(result.call_id or "")
    answered = f"{call.id} {call.name}" if call else "no call"
    content = "".join(p.text for p in result.content if isinstance(p, TextPart))
    text = f"result for {result.call_id} answers {answered}: {content}"
    return [Usage(prompt_tokens=3), TextDelta(text=text), Usage(prompt_tokens=3, completion_tokens=1), Finished()]


async def _breaks_once(request: Request) -> AsyncIterator[Event]:
    yield Usage(prompt_tokens=2)
    yield TextDelta(text="first", tokens=(11,))
    if not request.resume:
        await asyncio.sleep(0.05)
        yield Failed(error=ErrorInfo(kind="BackendUnavailable", message="runner lost"))
        return
    yield TextDelta(text=" second", tokens=(12,))
    yield Usage(prompt_tokens=2, completion_tokens=2)
    yield Finished(reason="stop")


_CORE = asyncio.Lock()  # the scripted runner's one core, which costly counts take in turn


class ScriptedRunner:
    async def generate(self, request: Request) -> AsyncIterator[Event]:
        last = request.messages[-1].text.strip() if request.messages else (request.raw_prompt or "")
        if last == "crash":
            raise RuntimeError("the scripted backend crashed")
        if last == "breaks once":  # its replica is lost after one token; a resume (``Request.resume``) goes on
            async for event in _breaks_once(request):
                yield event
            return
        script = SCRIPTS.get(last)
        if last.startswith("sleep "):
            await asyncio.sleep(float(last.split()[1]))
            script = [
                Usage(prompt_tokens=2),
                TextDelta(text="slept"),
                Usage(prompt_tokens=2, completion_tokens=1),
                Finished(reason="stop"),
            ]
        elif request.messages and request.messages[-1].role == "tool":
            script = _answer_tool_result(request)
        elif last == "how long":
            words = await self.count_tokens(request)
            script = [
                Usage(prompt_tokens=words),
                TextDelta(text=f"{len(request.messages)} messages, {words} words"),
                Usage(prompt_tokens=words, completion_tokens=4),
                Finished(reason="stop"),
            ]
        if script is None:
            words = last.split()
            script = [
                Usage(prompt_tokens=len(words)),
                *(TextDelta(text=w + " ") for w in words),
                Usage(prompt_tokens=len(words), completion_tokens=len(words)),
                Finished(reason="stop"),
            ]
        for event in script:
            await asyncio.sleep(0)
            yield event

    async def count_tokens(self, request: Request) -> int:
        text = " ".join([m.text for m in request.messages] + [t.name for t in request.tools])
        async with _CORE:  # counts take the runner's core in turn; ``slowcount`` holds it as 1 MB of text would
            await asyncio.sleep(1.0 if "slowcount" in text else 0)
        return len(text.split())

    async def embed(self, request: EmbedRequest) -> Embeddings:
        if request.dimensions is not None and not 0 < request.dimensions <= EMBED_SIZE:
            raise InvalidRequest(f"dimensions must be between 1 and {EMBED_SIZE}", param="dimensions")
        vectors = tuple(scripted_vector(item, request.dimensions) for item in request.inputs)
        tokens = sum(len(item.split()) if isinstance(item, str) else len(item) for item in request.inputs)
        return Embeddings(vectors=vectors, prompt_tokens=tokens)


EMBED_SIZE = 4


def scripted_vector(item: str | tuple[int, ...], dimensions: int | None = None) -> tuple[float, ...]:
    """A deterministic unit vector for ``item`` (from its SHA-256), cut to ``dimensions``, in float32 values."""
    digest = hashlib.sha256(item.encode() if isinstance(item, str) else bytes(str(item), "ascii")).digest()
    raw = [b - 127.5 for b in digest[: dimensions or EMBED_SIZE]]
    norm = math.sqrt(sum(x * x for x in raw))
    return struct.unpack(f"<{len(raw)}f", struct.pack(f"<{len(raw)}f", *(x / norm for x in raw)))


class ScriptedBackend(Backend):
    """``context`` and ``describe`` are ``Backend``'s defaults: the card's context length and family."""

    name = "scripted"

    def supports(self, card: ModelCard) -> bool:
        return card.format == "scripted"

    def capabilities(self, card: ModelCard) -> Capabilities:
        return Capabilities(tools=True, vision=True, json_schema=True, reasoning=True, embeddings=True)

    def strategies(self, card: ModelCard) -> frozenset[str]:
        return frozenset({"single", "pipeline"} if card.size > 1 << 30 else {"single"})

    def spec(self, card: ModelCard) -> ModelSpec:
        if card.size > 1 << 30:
            return ModelSpec(
                name=card.name,
                n_layers=16,
                hidden_size=2048,
                n_heads=16,
                n_kv_heads=4,
                head_dim=128,
                context_length=card.context_length,
                layer_bytes=card.size // 16,
            )
        return ModelSpec(
            name=card.name,
            n_layers=1,
            hidden_size=8,
            n_heads=1,
            n_kv_heads=1,
            head_dim=8,
            context_length=card.context_length,
            layer_bytes=1 << 20,
        )

    def costs(self, card: ModelCard) -> ShardCosts:
        return ShardCosts()

    def calibrate(self) -> None:
        """Nothing to measure; ``SCRIPTED_CALIBRATE_SECONDS`` makes it take that long (a slow machine's real one)."""
        time.sleep(float(os.environ.get("SCRIPTED_CALIBRATE_SECONDS", "0")))

    async def launch(
        self, card: ModelCard, placement: Candidate, shard: Shard, *, host: str, peers: Peers
    ) -> InProcess:
        return InProcess()

    def connect(self, card: ModelCard, placement: Candidate, urls: Mapping[str, str]) -> ScriptedRunner:
        return ScriptedRunner()


class ScriptedSource:
    name = "scripted"

    def models(self) -> Sequence[ModelCard]:
        return [CARD, BIG, HUGE, SLASHED]


@hookimpl
def meshgate_register_backends(register: Callable[[Backend], None], settings, http) -> None:
    register(ScriptedBackend())


@hookimpl
def meshgate_register_model_sources(register: Callable[[ModelSource], None], settings) -> None:
    register(ScriptedSource())
