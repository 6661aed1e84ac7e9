"""A stream that moves to another replica mid-way: the llama.cpp engine's ``Request.resume`` and the gateway's
``resume.resumable``, together on the real model in this process.

A "replica" here is an engine's ``generate`` cut off after some of its content events with the runner client's
``BackendUnavailable``; the ``Resume`` starts the same request on a second engine with the token ids those events
carried. What the client would see (the events ``resumable`` relays) must equal, event for event, what an
undisturbed run sends: free text, text ended by a stop string, JSON held to a schema, and a forced tool call.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest

from meshgate.backends.llama_cpp.engine import LlamaEngine
from meshgate.gateway.serving.resume import resumable
from meshgate.protocols.model import (
    BackendUnavailable,
    Event,
    Failed,
    Finished,
    GatewayError,
    KeepAlive,
    Message,
    ReasoningDelta,
    Request,
    ResponseFormat,
    Sampling,
    TextDelta,
    TextPart,
    Tool,
    ToolCallDelta,
    ToolChoice,
    Usage,
)

CONTENT = (TextDelta, ReasoningDelta, ToolCallDelta)


@pytest.fixture(scope="module")
def engines(packaged_gguf: Path) -> Iterator[tuple[LlamaEngine, LlamaEngine]]:
    """Two engines on the packaged model: the replica that fails and the one that takes over."""
    pair = (
        LlamaEngine(str(packaged_gguf), n_ctx=1024, n_threads=2, parallel=1),
        LlamaEngine(str(packaged_gguf), n_ctx=1024, n_threads=2, parallel=4),
    )
    yield pair
    for engine in pair:
        engine.scheduler.close()


def _events(engine: LlamaEngine, request: Request) -> list[Event]:
    return [e for e in engine.generate(request, threading.Event()) if not isinstance(e, KeepAlive)]


def _strip(events: list[Event]) -> list[Event]:
    """What a client sees of events, less what differs between undisturbed runs too: no token ids, no timings,
    no random call ids."""
    out: list[Event] = []
    for event in events:
        if isinstance(event, ToolCallDelta) and event.id:
            event = msgspec.structs.replace(event, id="call")  # each run draws its call ids
        if isinstance(event, CONTENT):
            event = msgspec.structs.replace(event, tokens=())
        elif isinstance(event, Usage):
            event = Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens)
        elif isinstance(event, KeepAlive):
            continue
        out.append(event)
    return out


async def _relayed(engines: tuple[LlamaEngine, LlamaEngine], request: Request, cut: int) -> list[Event]:
    """What ``resumable`` relays when the first engine's stream fails after ``cut`` content events."""
    first, second = engines

    async def failing() -> AsyncIterator[Event]:
        sent = 0
        for event in _events(first, request):
            if isinstance(event, CONTENT):
                if sent == cut:
                    yield Failed(error=BackendUnavailable("the runner closed the stream before finishing").info())
                    return
                sent += 1
            yield event

    asked: list[tuple[int, ...]] = []

    async def resume(tokens: tuple[int, ...], error: GatewayError) -> AsyncIterator[Event]:
        assert isinstance(error, BackendUnavailable)
        asked.append(tokens)

        async def events() -> AsyncIterator[Event]:
            for event in _events(second, msgspec.structs.replace(request, resume=tokens)):
                yield event

        return events()

    out = [e async for e in resumable(failing(), resume, wait=30, keepalive=1)]
    assert len(asked) == 1, asked  # one resume, with the ids the relayed events carried
    return out


def _chat(text: str, **fields) -> Request:
    return Request(
        model="m",
        messages=(Message(role="user", parts=(TextPart(text=text),)),),
        sampling=Sampling(temperature=0.0),
        max_tokens=fields.pop("max_tokens", 24),
        **fields,
    )


CASES = {
    "text": _chat("Write a short story about a lighthouse keeper."),
    "stop": _chat("List the planets of the solar system, one per line.", stop=("solar system.\nThe",), max_tokens=40),
    "json": _chat(
        "Describe a city as JSON.",
        max_tokens=40,
        response_format=ResponseFormat(
            kind="json_schema",
            schema={
                "type": "object",
                "properties": {"name": {"type": "string"}, "people": {"type": "integer", "minimum": 1}},
                "required": ["name", "people"],
            },
        ),
    ),
    "tool": _chat(
        "What is the weather in Paris?",
        max_tokens=40,
        tools=(
            Tool(
                name="weather",
                description="The weather in a city",
                parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            ),
        ),
        tool_choice=ToolChoice(mode="required"),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_resumed_stream_sends_what_an_undisturbed_one_sends(engines, case: str) -> None:
    request = CASES[case]
    whole = _events(engines[0], request)
    content = [e for e in whole if isinstance(e, CONTENT)]
    assert len(content) >= 4, whole
    assert all(e.tokens for e in content[:1]), content[:1]  # the first delta carries its token's id
    ids = [t for e in content for t in e.tokens]
    usage = [e for e in whole if isinstance(e, Usage)][-1]
    assert len(ids) <= usage.completion_tokens
    for cut in (0, len(content) // 2) if case == "text" else (len(content) // 2,):  # a plain retry, then midway
        relayed = asyncio.run(_relayed(engines, request, cut))
        assert _strip(relayed) == _strip(whole), (case, cut)
        assert isinstance(relayed[-1], Finished)
        assert case != "stop" or relayed[-1].reason == "stop_sequence", relayed[-1]  # the stop string held


def test_resumes_side_by_side_go_on_as_the_undisturbed_run(engines) -> None:
    """Four resumes of one greedy request at once, cut at different tokens, on one runner: each gives the
    undisturbed text. Their resumed tokens are decoded one step each, as they were generated (``Job.forced``);
    prefilled as a prompt chunk (and shared between the slots as a prefix) they got other numbers and the text
    of the shortest one went another way."""
    request = _chat("Count from one to one thousand, one number per line.", max_tokens=40)
    whole = [e for e in _events(engines[0], request) if isinstance(e, TextDelta)]
    ids = [t for e in whole for t in e.tokens]
    text = "".join(e.text for e in whole)

    def resumed(cut: int) -> str:
        events = _events(engines[1], msgspec.structs.replace(request, resume=tuple(ids[:cut])))
        return "".join(e.text for e in events if isinstance(e, TextDelta))

    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(resumed, (5, 12, 20, 33)))
    assert texts == [text] * 4


def test_a_sampled_resume_goes_on_validly_under_its_schema(engines) -> None:
    """With sampling (temperature 0.9, seed 11) a resumed stream is not the draw the failed replica would have
    made, but a valid continuation: what was sent before the cut is kept as sent, the rest follows from it under
    the same grammar state, so the whole text is JSON its schema accepts, and usage counts every token the client
    got. The seed moves on by the tokens already sent, so the same cut resumes to the same text."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "people": {"type": "integer", "minimum": 1, "maximum": 999},
        },
        "required": ["name", "people"],
        "additionalProperties": False,
    }
    request = msgspec.structs.replace(
        CASES["json"],
        sampling=Sampling(temperature=0.9, seed=11),
        response_format=ResponseFormat(kind="json_schema", schema=schema),
        max_tokens=120,
    )
    whole = [e for e in _events(engines[0], request) if isinstance(e, CONTENT)]
    cut = len(whole) // 2
    assert cut >= 2, whole
    runs = [asyncio.run(_relayed(engines, request, cut)) for _ in range(2)]
    texts = ["".join(e.text for e in run if isinstance(e, TextDelta)) for run in runs]
    sent = [e for e in runs[0] if isinstance(e, CONTENT)]
    assert [e.text for e in sent[:cut]] == [e.text for e in whole[:cut]]  # the part before the cut, as sent
    assert runs[0][-1].reason == "stop", (runs[0][-1], texts[0])
    answer = msgspec.json.decode(texts[0])
    assert set(answer) == {"name", "people"} and isinstance(answer["people"], int) and 1 <= answer["people"] <= 999
    assert isinstance(answer["name"], str) and len(answer["name"]) <= 12, answer
    assert texts[1] == texts[0]  # the seed is carried: the same resume draws the same continuation
    assert isinstance(runs[0][-1], Finished), runs[0][-1]
    usage = [e for e in runs[0] if isinstance(e, Usage)][-1]
    assert usage.completion_tokens >= sum(len(e.tokens) for e in sent) > 0, usage


def test_a_resume_its_schema_forbids_is_a_server_error(engines) -> None:
    """Tokens handed on that the response format's grammar rejects (they came from a replica, not the client) fail
    the request as the gateway's own error (500), not as a 4xx that would tell the client to change its body."""
    engine = engines[1]
    forbidden = tuple(engine.llm.tokenize(b"hello", add_bos=False, special=False))
    with pytest.raises(GatewayError) as failed:
        _events(engine, msgspec.structs.replace(CASES["json"], resume=forbidden))
    assert type(failed.value) is GatewayError and failed.value.status == 500, failed.value
    assert failed.value.message.startswith("structured output failed: the grammar rejects a resumed token")


def test_a_backend_without_token_ids_is_not_resumed() -> None:
    """Deltas without ``tokens`` (a backend that cannot resume): after content, the failure goes to the client."""

    async def stream() -> AsyncIterator[Event]:
        yield TextDelta(text="Hello")
        yield Failed(error=BackendUnavailable("gone").info())

    async def resume(tokens, error):
        raise AssertionError("resumed a stream whose tokens are unknown")

    out = asyncio.run(_collect(resumable(stream(), resume, wait=5, keepalive=1)))
    assert [type(e) for e in out] == [TextDelta, Failed]


def test_no_replica_in_time_gives_the_original_failure() -> None:
    async def stream() -> AsyncIterator[Event]:
        yield Usage(prompt_tokens=3)
        yield TextDelta(text="Hi", tokens=(5,))
        yield Failed(error=BackendUnavailable("the runner closed the stream before finishing").info())

    async def resume(tokens, error):
        await asyncio.sleep(10)

    out = asyncio.run(_collect(resumable(stream(), resume, wait=0.3, keepalive=0.1)))
    assert isinstance(out[-1], Failed) and out[-1].error.kind == "BackendUnavailable", out
    assert any(isinstance(e, KeepAlive) for e in out)  # the client heard from the stream while it waited


async def _collect(events: AsyncIterator[Event]) -> list[Event]:
    return [e async for e in events]
