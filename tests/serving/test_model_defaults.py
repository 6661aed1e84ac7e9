"""A user model's stored defaults as ``gateway.serving.model_defaults`` applies them: pure functions on internal
requests."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from meshgate.backends.base import Capabilities
from meshgate.backends.registry import ModelRegistry, UserModel
from meshgate.gateway.serving.model_defaults import UserModels, apply_defaults, end_turn_at_default_stops
from meshgate.gateway.serving.prepare import prepare
from meshgate.protocols.model import UNSET, Finished, Message, Request, Sampling, TextDelta, TextPart

CAPS = Capabilities()


def _model(system: str = "", **parameters) -> UserModel:
    return UserModel(path="/m.gguf", digest="d", created=0.0, system=system, parameters=parameters)


def _user(text: str = "Hi") -> Message:
    return Message(role="user", parts=(TextPart(text=text),))


def _request(**fields) -> Request:
    return Request(model="brief", messages=(_user(),), **fields)


def test_no_user_model_or_nothing_stored_leaves_the_request_as_it_is():
    request = _request()
    assert apply_defaults(request, None) is request
    assert apply_defaults(request, _model()) is request


def test_stored_values_fill_what_the_request_left_unset():
    model = _model(
        "Answer in one short line.",
        stop=["\n", "User:"],
        num_predict=24,
        num_ctx=8192,
        temperature=0.2,
        top_k=20,
        top_p=0.9,
        min_p=0.05,
        seed=7,
        repeat_penalty=1.1,
    )
    got = apply_defaults(_request(), model)
    assert got.stop == ("\n", "User:")
    assert got.max_tokens == 24 and got.num_ctx == 8192
    assert got.sampling == Sampling(temperature=0.2, top_k=20, top_p=0.9, min_p=0.05, seed=7, repeat_penalty=1.1)
    assert [m.role for m in got.messages] == ["system", "user"]
    assert got.messages[0].text == "Answer in one short line."


def test_the_request_always_wins():
    model = _model("Stored.", stop=["\n"], num_predict=24, num_ctx=8192, temperature=0.2, seed=7)
    system = Message(role="system", parts=(TextPart(text="Mine."),))
    request = Request(
        model="brief",
        messages=(system, _user()),
        stop=("END",),
        max_tokens=100,
        num_ctx=2048,
        sampling=Sampling(temperature=1.0, seed=None),  # an explicit null is the client's choice too
    )
    got = apply_defaults(request, model)
    assert got.stop == ("END",) and got.max_tokens == 100 and got.num_ctx == 2048
    assert got.sampling.temperature == 1.0 and got.sampling.seed is None
    assert [m.text for m in got.messages] == ["Mine.", "Hi"]


def test_ollama_style_values_strings_and_a_single_stop():
    got = apply_defaults(_request(), _model(stop="###", temperature="0.5", top_k="40", num_predict="12"))
    assert got.stop == ("###",) and got.sampling.temperature == 0.5 and got.sampling.top_k == 40
    assert got.max_tokens == 12


def test_bad_or_out_of_range_values_are_skipped():
    got = apply_defaults(
        _request(),
        _model(temperature="hot", top_p=3, top_k=-1, num_ctx=0, seed=True, stop=[1, ""], min_p=float("nan")),
    )
    assert got.sampling == Sampling() and got.stop == () and got.num_ctx is UNSET


def test_num_predict_of_zero_or_less_means_no_limit():
    assert apply_defaults(_request(), _model(num_predict=-1)).max_tokens is None
    assert apply_defaults(_request(), _model(num_predict=0)).max_tokens is None


def test_a_raw_prompt_gets_no_system_message():
    request = Request(model="brief", raw_prompt="Once upon a time")
    assert apply_defaults(request, _model("Stored.")).messages == ()


async def _events(*events):
    for event in events:
        yield event


def _collect(stream) -> list:
    async def run():
        return [event async for event in stream]

    return asyncio.run(run())


def test_a_default_stop_ends_the_turn_but_the_clients_own_stop_stays_a_stop_sequence():
    model = _model(stop=["\n"])
    matched = (TextDelta(text="Hello."), Finished(reason="stop_sequence", stop_sequence="\n"))
    ready = prepare(_request(), model="m", user_model=model, capabilities=CAPS, max_tokens=100, clamp_output=False)
    assert ready.defaults_end_turn and ready.request.stop == ("\n",)
    assert _collect(end_turn_at_default_stops(_events(*matched)))[-1] == Finished(reason="stop")
    own = prepare(
        _request(stop=("\n",)), model="m", user_model=model, capabilities=CAPS, max_tokens=100, clamp_output=False
    )
    assert not own.defaults_end_turn  # the client's own stop: the dispatcher leaves the stream as it is
    length = (TextDelta(text="Hello"), Finished(reason="length"))
    assert _collect(end_turn_at_default_stops(_events(*length)))[-1] == Finished(reason="length")


def test_closing_the_wrapped_stream_closes_the_dispatchers():
    closed = []

    async def inner():
        try:
            yield TextDelta(text="a")
            yield TextDelta(text="b")
        finally:
            closed.append(True)

    stream = end_turn_at_default_stops(inner())

    async def run():
        assert await anext(stream) == TextDelta(text="a")
        await stream.aclose()

    asyncio.run(run())
    assert closed == [True]


def test_user_models_reads_the_registry_again_when_it_changes(tmp_path: Path):
    registry = ModelRegistry.in_data_dir(tmp_path)
    user_models = UserModels(registry)
    assert user_models("brief:latest") is None  # no registry file yet
    registry.put("brief:latest", UserModel(path="/m.gguf", digest="d", created=time.time(), system="One."))
    assert user_models("brief:latest").system == "One."
    registry.put("brief:latest", UserModel(path="/m.gguf", digest="d", created=time.time(), system="Two."))
    assert user_models("brief:latest").system == "Two."
    registry.remove("brief:latest")
    assert user_models("brief:latest") is None
