"""LiteLLM as a client of meshgate's OpenAI API (``openai/<model>`` with ``api_base``): chat, streaming, a forced
tool call, structured output (``response_format`` from a Pydantic model)."""

import json

import litellm
from _checks import (
    ASK,
    KEY,
    MODEL,
    REVIEW_ASK,
    STAT_ASK,
    TOOL_ASK,
    TYPED_TOKENS,
    URL,
    WEATHER_SCHEMA,
    Review,
    Stat,
    run_checks,
    valid_review,
    valid_stat,
)

BASE = {"model": f"openai/{MODEL}", "api_base": f"{URL}/v1", "api_key": KEY, "temperature": 0}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather.", "parameters": WEATHER_SCHEMA},
}


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def chat() -> str:
    text = litellm.completion(**BASE, messages=user(ASK), max_tokens=16).choices[0].message.content
    assert text.strip(), "empty answer"
    return repr(text)


def stream() -> str:
    chunks = litellm.completion(**BASE, messages=user(ASK), max_tokens=16, stream=True)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1 and "".join(pieces).strip(), pieces
    return f"{len(pieces)} chunks"


def forced_tool() -> str:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    message = litellm.completion(**BASE, messages=user(TOOL_ASK), tools=[WEATHER], tool_choice=choice, max_tokens=32)
    (call,) = message.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and isinstance(args["location"], str), call
    return f"{call.function.name}({args})"


def structured() -> str:
    answer = litellm.completion(**BASE, messages=user(REVIEW_ASK), response_format=Review, max_tokens=32)
    return valid_review(Review.model_validate_json(answer.choices[0].message.content))


def typed() -> str:
    answer = litellm.completion(**BASE, messages=user(STAT_ASK), response_format=Stat, max_tokens=TYPED_TOKENS)
    return valid_stat(Stat.model_validate_json(answer.choices[0].message.content))


run_checks("litellm", chat, stream, forced_tool, structured, typed)
