"""The official clients, pointed at the shared real-model gateway (``real_server``)."""

from __future__ import annotations

import anthropic
import ollama
import openai
import pytest


@pytest.fixture(scope="module")
def oai(real_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{real_server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def ant(real_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=real_server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def oll(real_server) -> ollama.Client:
    return ollama.Client(host=real_server.url)
