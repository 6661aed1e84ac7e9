"""LangChain's ChatOllama against meshgate's Ollama API: chat, streaming, a forced tool call (tools with
``format``, as Ollama has no tool_choice), structured output (``format`` = the JSON schema)."""

from _checks import (
    ASK,
    MODEL,
    REVIEW_ASK,
    STAT_ASK,
    TOOL_ASK,
    TYPED_TOKENS,
    URL,
    WEATHER_SCHEMA,
    Review,
    Stat,
    get_weather,
    run_checks,
    valid_review,
    valid_stat,
)
from langchain_core.tools import tool
from langchain_ollama import ChatOllama

llm = ChatOllama(base_url=URL, model=MODEL, temperature=0, num_predict=16)


def chat() -> str:
    text = llm.invoke(ASK).text
    assert text.strip(), "empty answer"
    return repr(text)


def stream() -> str:
    pieces = [chunk.text for chunk in llm.stream(ASK)]
    assert len(pieces) > 1 and "".join(pieces).strip(), pieces
    return f"{len(pieces)} chunks"


def forced_tool() -> str:
    forced = ChatOllama(base_url=URL, model=MODEL, temperature=0, num_predict=32, format=WEATHER_SCHEMA)
    (call,) = forced.bind_tools([tool(get_weather)]).invoke(TOOL_ASK).tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["location"], str), call
    return f"{call['name']}({call['args']})"


def structured() -> str:
    review = llm.bind(num_predict=32).with_structured_output(Review, method="json_schema").invoke(REVIEW_ASK)
    return valid_review(review)


def typed() -> str:
    stat = llm.bind(num_predict=TYPED_TOKENS).with_structured_output(Stat, method="json_schema").invoke(STAT_ASK)
    return valid_stat(stat)


run_checks("langchain-ollama", chat, stream, forced_tool, structured, typed)
