"""LangChain's ChatOpenAI against meshgate's OpenAI API: chat, streaming, a forced tool call, structured output."""

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
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

llm = ChatOpenAI(base_url=f"{URL}/v1", api_key=KEY, model=MODEL, temperature=0, max_tokens=16)


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
    review = llm.bind(max_tokens=32).with_structured_output(Review, method="json_schema").invoke(REVIEW_ASK)
    return valid_review(review)


def typed() -> str:
    stat = llm.bind(max_tokens=TYPED_TOKENS).with_structured_output(Stat, method="json_schema").invoke(STAT_ASK)
    return valid_stat(stat)


run_checks("langchain-openai", chat, stream, forced_tool, structured, typed)
