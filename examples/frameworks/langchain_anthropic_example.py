"""LangChain's ChatAnthropic against meshgate's Anthropic Messages API: chat, streaming, a forced tool call,
structured output (a forced tool, LangChain's default for Anthropic)."""

from _checks import (
    ASK,
    KEY,
    MODEL,
    REVIEW_ASK,
    STAT_ASK,
    TOOL_ASK,
    TYPED_TOKENS,
    URL,
    Review,
    Stat,
    get_weather,
    run_checks,
    valid_review,
    valid_stat,
)
from langchain_anthropic import ChatAnthropic
from langchain_core.tools import tool

llm = ChatAnthropic(base_url=URL, api_key=KEY, model=MODEL, temperature=0, max_tokens=16)


def chat() -> str:
    text = llm.invoke(ASK).text
    assert text.strip(), "empty answer"
    return repr(text)


def stream() -> str:
    pieces = [chunk.text for chunk in llm.stream(ASK)]
    assert len(pieces) > 1 and "".join(pieces).strip(), pieces
    return f"{len(pieces)} chunks"


def forced_tool() -> str:
    (call,) = llm.bind_tools([tool(get_weather)], tool_choice="get_weather").invoke(TOOL_ASK).tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["location"], str), call
    return f"{call['name']}({call['args']})"


def structured() -> str:
    review = llm.bind(max_tokens=32).with_structured_output(Review).invoke(REVIEW_ASK)
    return valid_review(review)


def typed() -> str:
    return valid_stat(llm.bind(max_tokens=TYPED_TOKENS).with_structured_output(Stat).invoke(STAT_ASK))


run_checks("langchain-anthropic", chat, stream, forced_tool, structured, typed)
