"""A batch line on the real model (the packaged Gemma 3 270M): its greedy answer is the same text as the same
request sent interactively (the line runs through the same dispatch, at the batch class)."""

from __future__ import annotations

import io
import json
import time

import anthropic
import openai

from tests.conftest import MODEL


def test_a_greedy_batch_line_answers_as_the_interactive_request(real_server):
    client = openai.OpenAI(base_url=f"{real_server.url}/v1", api_key="x", max_retries=0, timeout=120)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name three colours."}],
        "temperature": 0,
        "max_tokens": 24,
    }
    interactive = client.chat.completions.create(**body)
    line = {"custom_id": "colours", "method": "POST", "url": "/v1/chat/completions", "body": body}
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(json.dumps(line).encode())), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 1, batch
    (output,) = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    answer = output["response"]["body"]
    assert output["custom_id"] == "colours" and answer["service_tier"] == "flex"
    assert answer["choices"][0]["message"]["content"] == interactive.choices[0].message.content
    assert interactive.service_tier == "default"


def test_a_greedy_message_batch_answers_as_the_interactive_request(real_server):
    client = anthropic.Anthropic(base_url=real_server.url, api_key="x", max_retries=0, timeout=120)
    params = {
        "model": MODEL,
        "max_tokens": 24,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Name three animals."}],
    }
    interactive = client.messages.create(  # this SDK's create() takes no temperature: sent as the wire has it
        **{k: v for k, v in params.items() if k != "temperature"}, extra_body={"temperature": 0}
    )
    made = client.messages.batches.create(requests=[{"custom_id": "animals", "params": params}])
    deadline = time.monotonic() + 120
    while made.processing_status != "ended" and time.monotonic() < deadline:
        time.sleep(0.2)
        made = client.messages.batches.retrieve(made.id)
    assert made.processing_status == "ended" and made.request_counts.succeeded == 1, made
    results = {r.custom_id: r.result for r in client.messages.batches.results(made.id)}
    assert results["animals"].type == "succeeded"
    message = results["animals"].message
    assert message.content[0].text == interactive.content[0].text and message.usage.service_tier == "batch"
    assert interactive.usage.service_tier == "standard"
