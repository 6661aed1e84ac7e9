"""Run under openai 1.x: drives ``client.responses`` against a scripted meshgate server, prints what it saw as JSON."""

import json
import sys

import openai

url = sys.argv[1]
client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
seen = {"version": openai.__version__}
reply = client.responses.create(model="scripted", input="hello")
seen["text"], seen["total_tokens"] = reply.output_text, reply.usage.total_tokens
with client.responses.stream(model="scripted", input="hello") as stream:
    seen["deltas"] = [e.delta for e in stream if e.type == "response.output_text.delta"]
    seen["final"] = stream.get_final_response().output_text
events = list(client.responses.create(model="scripted", input="fail", stream=True))
seen["fail"] = [events[-1].type, events[-1].response.error.message]
events = list(client.responses.create(model="scripted", input="length", stream=True))
seen["length"] = [events[-1].type, events[-1].response.incomplete_details.reason]
print(json.dumps(seen))
