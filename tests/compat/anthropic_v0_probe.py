"""Run under anthropic 0.x: exercises a meshgate server and prints what the SDK saw, as JSON.

0.x sends ``x-api-key`` and ``anthropic-version: 2023-06-01``; its beta client posts to ``?beta=true``.
"""

import json
import sys

import anthropic

url, model = sys.argv[1], sys.argv[2]
client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
seen = {"version": anthropic.__version__}
message = client.messages.create(
    model=model, max_tokens=4, temperature=0, system="Be brief.", messages=[{"role": "user", "content": "hello"}]
)
seen["text"] = message.content[0].text
seen["stop_reason"] = message.stop_reason
with client.messages.stream(
    model=model, max_tokens=4, temperature=0, messages=[{"role": "user", "content": "hello"}]
) as s:
    seen["stream_text"] = "".join(s.text_stream)
    seen["stream_output_tokens"] = s.get_final_message().usage.output_tokens
beta = client.beta.messages.create(
    model=model, max_tokens=4, messages=[{"role": "user", "content": "hello"}], betas=["token-counting-2024-11-01"]
)
seen["beta_text"] = beta.content[0].text
seen["models"] = [m.id for m in client.models.list()]
try:
    client.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "x"}])
except anthropic.NotFoundError as exc:
    seen["not_found"] = exc.body["error"]["type"]
if model == "scripted":
    with client.messages.stream(
        model=model,
        max_tokens=50,
        messages=[{"role": "user", "content": "tool"}],
        tools=[{"name": "get_weather", "input_schema": {"type": "object"}}],
    ) as s:
        block = s.get_final_message().content[0]
    seen["tool_use"] = [block.name, block.input]
    try:
        with client.messages.stream(model=model, max_tokens=50, messages=[{"role": "user", "content": "fail"}]) as s:
            list(s)
    except anthropic.APIStatusError as exc:
        seen["mid_stream_error"] = [exc.status_code, exc.body["error"]["type"]]
print(json.dumps(seen))
