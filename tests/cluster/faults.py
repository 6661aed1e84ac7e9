"""A long streaming chat through one official SDK, for tests that kill a process mid-generation, and whether a
process still runs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
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


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie waiting to be reaped does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False
