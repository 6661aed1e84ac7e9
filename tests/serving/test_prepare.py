"""``gateway.serving.prepare``: what a request becomes before routing, as a table (pure: no process, no loop)."""

from __future__ import annotations

import pytest

from meshgate.backends.base import Capabilities
from meshgate.backends.registry import UserModel
from meshgate.gateway.serving.prepare import prepare
from meshgate.protocols.model import (
    Message,
    OutputTooLarge,
    Request,
    ResponseFormat,
    Sampling,
    TextPart,
    Tool,
    UnsupportedFeature,
)

ALL = Capabilities(tools=True, json_schema=True)
PLAIN = Capabilities()
TOOL = Tool(name="f", description="", parameters={"type": "object"})


def _request(**fields) -> Request:
    return Request(model="m", messages=(Message(role="user", parts=(TextPart(text="hi"),)),), **fields)


def _model(system: str = "", **parameters) -> UserModel:
    return UserModel(path="/m.gguf", digest="d", created=0.0, system=system, parameters=parameters)


# (case, request fields, user model, capabilities, max_tokens setting, clamp) -> what is routed, or the error
ROWS = [
    (
        "nothing to do",
        {},
        None,
        PLAIN,
        100,
        False,
        {"max_tokens": None, "stop": (), "context": None, "end_turn": False},
    ),
    ("within the cap", {"max_tokens": 100}, None, PLAIN, 100, False, {"max_tokens": 100}),
    ("above the cap, refused", {"max_tokens": 101}, None, PLAIN, 100, False, OutputTooLarge),
    ("above the cap, clamped (Ollama)", {"max_tokens": 500}, None, PLAIN, 100, True, {"max_tokens": 100}),
    ("Modelfile num_predict fills max_tokens", {}, _model(num_predict=64), PLAIN, 100, False, {"max_tokens": 64}),
    # the cap comes first: a Modelfile's default is the model owner's, not the client's, and is not refused
    ("Modelfile num_predict past the cap", {}, _model(num_predict=500), PLAIN, 100, False, {"max_tokens": 500}),
    ("the client's max_tokens wins", {"max_tokens": 8}, _model(num_predict=64), PLAIN, 100, False, {"max_tokens": 8}),
    ("Modelfile num_ctx is the context", {}, _model(num_ctx=8192), PLAIN, 100, False, {"context": 8192}),
    ("the client's num_ctx wins", {"num_ctx": 2048}, _model(num_ctx=8192), PLAIN, 100, False, {"context": 2048}),
    ("a default stop ends the turn", {}, _model(stop=["\n"]), PLAIN, 100, False, {"stop": ("\n",), "end_turn": True}),
    (
        "the client's stop stays its own",
        {"stop": ("x",)},
        _model(stop=["\n"]),
        PLAIN,
        100,
        False,
        {"stop": ("x",), "end_turn": False},
    ),  # fmt: skip
    ("Modelfile temperature", {}, _model(temperature=0.2), PLAIN, 100, False, {"temperature": 0.2}),
    (
        "the client's temperature",
        {"sampling": Sampling(temperature=1.0)},
        _model(temperature=0.2),
        PLAIN,
        100,
        False,
        {"temperature": 1.0},
    ),  # fmt: skip
    ("Modelfile system prompt", {}, _model(system="Be brief."), PLAIN, 100, False, {"system": "Be brief."}),
    ("tools the backend cannot call", {"tools": (TOOL,)}, None, PLAIN, 100, False, UnsupportedFeature),
    ("tools it can", {"tools": (TOOL,)}, None, ALL, 100, False, {"max_tokens": None}),
    (
        "a schema it cannot enforce",
        {"response_format": ResponseFormat(kind="json_schema", schema={})},
        None,
        PLAIN,
        100,
        False,
        UnsupportedFeature,
    ),  # fmt: skip
]


@pytest.mark.parametrize(
    ("case", "fields", "model", "caps", "limit", "clamp", "expected"), ROWS, ids=[r[0] for r in ROWS]
)
def test_prepare(case, fields, model, caps, limit, clamp, expected) -> None:
    request = _request(**fields)
    if isinstance(expected, type):
        with pytest.raises(expected):
            prepare(request, model="m", user_model=model, capabilities=caps, max_tokens=limit, clamp_output=clamp)
        return
    ready = prepare(request, model="m", user_model=model, capabilities=caps, max_tokens=limit, clamp_output=clamp)
    sent = ready.request
    seen = {
        "max_tokens": sent.max_tokens,
        "stop": sent.stop,
        "context": ready.context,
        "end_turn": ready.defaults_end_turn,
        "temperature": sent.sampling.temperature,
        "system": next((m.text for m in sent.messages if m.role == "system"), None),
    }
    assert {key: seen[key] for key in expected} == expected, case
