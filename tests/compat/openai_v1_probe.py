"""Run under openai 1.x: exercises a meshgate server and prints what the SDK saw, as JSON."""

import json
import sys

import openai

url, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
seen = {"version": openai.__version__}
limit = {"max_tokens": 4, "temperature": 0}  # the scripted answer is 2 tokens; the real model is held to 4, greedy
reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}], **limit)
seen["chat"] = reply.choices[0].message.content
seen["finish"] = reply.choices[0].finish_reason
chunks = list(
    client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hello"}],
        stream=True,
        stream_options={"include_usage": True},
        **limit,
    )
)
seen["stream_text"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
seen["stream_usage"] = chunks[-1].usage.total_tokens if chunks[-1].usage else None
seen["models"] = sorted(m.id for m in client.models.list())
seen["retrieved"] = client.models.retrieve("acme/scripted:v1").id if model == "scripted" else None
try:
    client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
except openai.NotFoundError as exc:
    seen["not_found"] = exc.body.get("code")
if model == "scripted":
    try:
        list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "fail"}], stream=True))
    except openai.APIError as exc:
        seen["mid_stream_error"] = exc.message
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with (
        client.beta.chat.completions.stream(model=model, messages=[{"role": "user", "content": "tool"}], tools=tools)
        if hasattr(client.beta.chat.completions, "stream")
        else client.chat.completions.stream(
            model=model, messages=[{"role": "user", "content": "tool"}], tools=tools
        ) as stream
    ):
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    seen["tool_call"] = [call.id, call.function.name, json.loads(call.function.arguments)]
print(json.dumps(seen))
