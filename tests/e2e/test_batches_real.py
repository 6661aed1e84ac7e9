"""A batch line on the real model (the packaged Gemma 3 270M): its greedy answer is the same text as the same
request sent interactively (the line runs through the same dispatch, at the batch class)."""

from __future__ import annotations

import io
import json
import time

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
