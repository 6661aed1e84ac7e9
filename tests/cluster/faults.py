"""Streaming chats through the official SDKs, for tests that kill a process mid-generation (a long sampled one;
greedy ones in all three protocols, as text pieces), whether a process still runs, and the streams a gateway
resumed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import ollama
import openai

LONG = [{"role": "user", "content": "Count from one to five hundred."}]


def long_stream(url: str, model: str, protocol: str, max_tokens: int = 400) -> tuple[Iterator, type[Exception]]:
    """A started stream of ``max_tokens`` through ``protocol``'s SDK and the error that SDK raises mid-stream."""
    if protocol == "openai":
        return iter(
            openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0).chat.completions.create(
                model=model, messages=LONG, max_tokens=max_tokens, stream=True
            )
        ), openai.APIError
    if protocol == "anthropic":
        return iter(
            anthropic.Anthropic(base_url=url, api_key="x", max_retries=0).messages.create(
                model=model, messages=LONG, max_tokens=max_tokens, stream=True
            )
        ), anthropic.APIStatusError
    return iter(
        ollama.Client(host=url).chat(model=model, messages=LONG, stream=True, options={"num_predict": max_tokens})
    ), ollama.ResponseError


def greedy_streams(url: str, model: str, prompt: str, max_tokens: int, key: str = "x") -> dict[str, Iterator[str]]:
    """A greedy streamed chat of ``max_tokens`` through each SDK (with API key ``key``), by protocol: iterators of
    the text pieces the client gets, started on the first ``next``."""
    messages = [{"role": "user", "content": prompt}]
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=180)
    ant = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=180)

    def openai_text() -> Iterator[str]:
        chunks = oai.chat.completions.create(
            model=model, stream=True, max_tokens=max_tokens, temperature=0, messages=messages
        )
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                yield chunk.choices[0].delta.content

    def anthropic_text() -> Iterator[str]:
        events = ant.messages.create(
            model=model, max_tokens=max_tokens, messages=messages, stream=True, extra_body={"temperature": 0}
        )
        for event in events:
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                yield event.delta.text

    def ollama_text() -> Iterator[str]:
        options = {"num_predict": max_tokens, "temperature": 0}
        client = ollama.Client(host=url, timeout=180, headers={"authorization": f"Bearer {key}"})
        for part in client.chat(model=model, stream=True, options=options, messages=messages):
            if part.message.content:
                yield part.message.content

    return {"openai": openai_text(), "anthropic": anthropic_text(), "ollama": ollama_text()}


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie waiting to be reaped does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def resumes(url: str) -> float:
    """Streams the gateway at ``url`` continued on another replica (``meshgate_stream_resumes_total``, all models)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith("meshgate_stream_resumes_total{"))
