"""The KV tier through a real gateway: a long prompt answered, the gateway (and so its runner) restarted over the
same disk tier, the same prompt answered again from it: no prefill, the same text, the restored tokens reported
as cached in OpenAI's usage, and the tier's figures in ``/metrics``."""

from __future__ import annotations

import tempfile
import time

import anthropic
import openai

from meshgate.backends.llama_cpp.kvstate import tail
from tests.conftest import MODEL, Server

WORDS = "the parser reads each token of the file and the linter reports a warning when a rule fails".split()
SYSTEM = "You review code. " + " ".join(f"{WORDS[(i * 5) % len(WORDS)]}{i % 71}" for i in range(1200))


def _ask(server: Server) -> tuple[str, int, int, float]:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    started = time.perf_counter()
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Summarise the rules."}],
        max_tokens=12,
        temperature=0,
    )
    details = answer.usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None else 0
    return answer.choices[0].message.content, answer.usage.prompt_tokens, cached or 0, time.perf_counter() - started


def test_a_restarted_gateway_answers_a_long_prompt_from_its_disk_tier(data_dir):
    with tempfile.TemporaryDirectory(prefix="meshgate-kv-") as kv:
        first = Server(data_dir, "--n-ctx", "4096", env={"MESHGATE_KV_DIR": kv, "MESHGATE_PARALLEL": "2"})
        try:
            text, prompt_tokens, cached, cold = _ask(first)
        finally:
            first.stop()
        assert prompt_tokens > 1024 and cached == 0
        again = Server(data_dir, "--n-ctx", "4096", env={"MESHGATE_KV_DIR": kv, "MESHGATE_PARALLEL": "2"})
        try:
            restored_text, _, restored, warm = _ask(again)
            claude = anthropic.Anthropic(base_url=again.url, api_key="unused", max_retries=0)
            message = claude.messages.create(
                model=MODEL,
                system=SYSTEM,
                messages=[{"role": "user", "content": "Summarise the rules."}],
                max_tokens=12,
                extra_body={"temperature": 0},
            )
        finally:
            again.stop()
    print(f"cold {cold:.2f} s, after a restart {warm:.2f} s (incl. the model's first placement)")
    assert restored == tail(prompt_tokens), "all but the last chunk came from the disk tier"
    assert restored_text == text
    assert message.usage.cache_read_input_tokens == tail(prompt_tokens)
    assert message.usage.input_tokens == prompt_tokens - tail(prompt_tokens) and message.content[0].text == text
