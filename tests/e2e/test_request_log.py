"""The request log (issue 17, part 3): one line per request on ``meshgate.requests``, in text or JSON, read from
real gateways' output. The gateways run the scripted backend with a bootstrap admin key, so each line can be
checked against exact token counts and a stored key's id."""

from __future__ import annotations

import json
import re
import socket
import time

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.conftest import MODEL, Server

BOOT = "boot-admin-key"
FIELDS = [
    "id",
    "protocol",
    "method",
    "path",
    "model",
    "key",
    "status",
    "prompt_tokens",
    "generated_tokens",
    "ttft_ms",
    "duration_ms",
    "instance",
    "class",  # the request's priority class (interactive or batch)
]
_PAIR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def parse(line: str) -> dict[str, str]:
    """A text line's ``key=value`` pairs after ``request``, in order (quoted values unescaped)."""
    text = line.split("meshgate.requests: request ", 1)[1]
    return {k: json.loads(v) if v.startswith('"') else v for k, v in _PAIR.findall(text)}


def logged(server: Server, request_id: str, timeout: float = 10.0) -> dict:
    """The log line of ``request_id`` (written when its response is done), as a dict."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in server.log.read_text(errors="replace").splitlines():
            if f"id={request_id} " in line:
                return parse(line)
            if line.startswith("{") and json.loads(line).get("id") == request_id:
                return json.loads(line)
        time.sleep(0.05)
    raise AssertionError(f"no log line for {request_id}:\n{server.log.read_text()[-3000:]}")


def make_key(server: Server) -> dict:
    made = httpx.post(
        f"{server.url}/keys",
        json={"name": "app", "scope": "inference"},
        headers={"authorization": f"Bearer {BOOT}"},
        timeout=30,
    )
    assert made.status_code == 201, made.text
    return made.json()


@pytest.fixture(scope="module")
def text_server(tmp_path_factory):
    server = Server(
        tmp_path_factory.mktemp("log-text"),
        "--plugin",
        "tests.scripted_plugin",
        "--api-key",
        BOOT,
        "--log-level",
        "info",
    )
    yield server
    server.stop()


def test_a_request_logs_one_line_with_its_id_key_tokens_and_instance(text_server):
    key = make_key(text_server)
    client = openai.OpenAI(base_url=f"{text_server.url}/v1", api_key=key["key"], max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="scripted", messages=[{"role": "user", "content": "hello"}]
    )
    rid = raw.headers["x-request-id"]
    assert raw.headers["request-id"] == rid and rid.startswith("req_")
    line = logged(text_server, rid)
    assert list(line) == FIELDS
    assert line["protocol"] == "openai" and line["method"] == "POST" and line["path"] == "/v1/chat/completions"
    assert (line["model"], line["key"], line["status"]) == ("scripted", key["id"], "200")
    assert (line["prompt_tokens"], line["generated_tokens"]) == ("7", "2")
    assert int(line["ttft_ms"]) <= int(line["duration_ms"]) and re.fullmatch(r"[0-9a-f]{12}", line["instance"])
    assert key["key"] not in text_server.log.read_text()  # the id, never the key

    stream = anthropic.Anthropic(base_url=text_server.url, api_key=key["key"], max_retries=0).messages.create(
        model="scripted", max_tokens=16, messages=[{"role": "user", "content": "hello"}], stream=True
    )
    events = list(stream)
    rid = stream.response.headers["request-id"]
    line = logged(text_server, rid)
    assert events and (line["protocol"], line["status"], line["generated_tokens"]) == ("anthropic", "200", "2")
    assert "error" not in line


def test_refused_requests_log_the_reason_the_client_got(text_server):
    unknown = anthropic.Anthropic(base_url=text_server.url, api_key=BOOT, max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as refused:
        unknown.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    line = logged(text_server, refused.value.response.headers["request-id"])
    assert (line["status"], line["model"], line["key"]) == ("404", "no-such-model", "boot:0")
    assert line["error"] == refused.value.body["error"]["message"]
    assert list(line) == [*FIELDS, "error"]

    with pytest.raises(ollama.ResponseError) as anonymous:
        ollama.Client(host=text_server.url).chat(model="scripted", messages=[{"role": "user", "content": "hi"}])
    assert anonymous.value.status_code == 401
    answer = httpx.post(f"{text_server.url}/api/chat", json={"model": "scripted", "messages": []}, timeout=30)
    line = logged(text_server, answer.headers["x-request-id"])
    assert (line["protocol"], line["status"], line["key"]) == ("ollama", "401", "-")
    assert line["error"] == answer.json()["error"] and "API key" in line["error"]

    missing = httpx.get(f"{text_server.url}/v1/no such thing", timeout=30)
    line = logged(text_server, missing.headers["x-request-id"])
    assert (line["status"], line["path"]) == ("404", "/v1/no such thing") and "no such endpoint" in line["error"]


def test_probes_are_quiet(text_server):
    probe = httpx.get(f"{text_server.url}/api/version", timeout=30)
    listing = httpx.get(f"{text_server.url}/api/tags", headers={"authorization": f"Bearer {BOOT}"}, timeout=30)
    logged(text_server, listing.headers["x-request-id"])  # logged after the probe, so the probe's line would be there
    assert probe.headers["x-request-id"] not in text_server.log.read_text()


def test_json_format_turns_every_line_into_an_object_with_the_same_keys(tmp_path):
    server = Server(tmp_path, "--plugin", "tests.scripted_plugin", "--log-level", "info", "--log-format", "json")
    try:
        answer = httpx.post(
            f"{server.url}/api/generate", json={"model": "scripted", "prompt": "hello", "stream": False}, timeout=30
        )
        assert answer.status_code == 200
        line = logged(server, answer.headers["x-request-id"])
    finally:
        server.stop()
    assert list(line) == ["time", "level", "logger", "message", *FIELDS]
    assert (line["level"], line["logger"], line["message"]) == ("INFO", "meshgate.requests", "request")
    assert (line["protocol"], line["path"], line["status"], line["key"]) == ("ollama", "/api/generate", 200, None)
    assert line["prompt_tokens"] == answer.json()["prompt_eval_count"] and isinstance(line["duration_ms"], int)
    objects = [json.loads(text) for text in server.log.read_text().splitlines() if text.strip()]
    assert {"uvicorn.error", "meshgate", "meshgate.requests"} <= {o["logger"] for o in objects}
    # start-up ends with where it listens and what it offers; the embedded agent's probe server says nothing
    served = [o["message"] for o in objects if o["message"].startswith("meshgate serving at")]
    assert len(served) == 1, served
    where, models = served[0].split("; models: ")
    assert where == f"meshgate serving at {server.url} (OpenAI /v1, Anthropic /v1/messages, Ollama /api, dashboard /ui)"
    assert "scripted" in models.split(", ")
    assert sum("Uvicorn running on" in o["message"] for o in objects) == 1


def test_a_stream_cut_short_logs_the_tokens_it_relayed(data_dir):
    """A client that goes away mid-stream never gets the final ``Usage`` (the runner's first one counts only the
    prompt); the line still counts the tokens relayed: at least the deltas the client read, short of the limit."""
    server = Server(data_dir, "--n-ctx", "1024", "--log-level", "info")
    try:
        ask = [{"role": "user", "content": "Count from 1 to 300, one number per line."}]
        body = {"model": MODEL, "messages": ask, "max_tokens": 400, "temperature": 0, "stream": True}  # no early end
        read = 0
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120) as answer:
            assert answer.status_code == 200
            rid = answer.headers["x-request-id"]
            for text in answer.iter_lines():
                if text.startswith("data: {"):
                    chunk = json.loads(text.removeprefix("data: "))
                    read += bool(chunk["choices"] and chunk["choices"][0]["delta"].get("content"))
                if read == 3:
                    break  # leaving the block closes the connection mid-stream
        line = logged(server, rid)
    finally:
        server.stop()
    assert line["status"] == "200" and line["prompt_tokens"] != "-", line
    assert 3 <= int(line["generated_tokens"]) < 400, line


def _lines_with(server: Server, status: str, path: str, timeout: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [
            parse(text)
            for text in server.log.read_text(errors="replace").splitlines()
            if "meshgate.requests: request " in text and f" status={status} " in text and f" path={path} " in text
        ]
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"no {status} line for {path}:\n{server.log.read_text()[-3000:]}")


def test_a_client_that_hangs_up_is_logged_and_counted_as_499(text_server):
    """Not 400: the client made no mistake, it left (while its answer was made, or before its body was sent)."""
    body = {"model": "scripted", "messages": [{"role": "user", "content": "sleep 5"}], "stream": False}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{text_server.url}/api/chat", json=body, headers={"authorization": f"Bearer {BOOT}"}, timeout=0.5)
    (line,) = _lines_with(text_server, "499", "/api/chat")
    assert line["model"] == "scripted" and "the client went away" in line["error"], line

    host, port = text_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:  # a body cut off: 10 of 100 bytes
        head = f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {BOOT}\r\n"
        conn.sendall(f"{head}content-type: application/json\r\ncontent-length: 100\r\n\r\n".encode() + b'{"model":"')
        time.sleep(0.3)
    (line,) = _lines_with(text_server, "499", "/v1/chat/completions")
    assert "the client went away" in line["error"], line

    metrics = httpx.get(f"{text_server.url}/metrics", headers={"authorization": f"Bearer {BOOT}"}, timeout=30).text
    counted = [m for m in metrics.splitlines() if m.startswith("meshgate_requests_total{") and 'status="499"' in m]
    assert {float(m.rsplit(" ", 1)[1]) for m in counted} == {1.0} and len(counted) == 2, counted
    assert not [m for m in metrics.splitlines() if m.startswith("meshgate_requests_total{") and 'status="400"' in m]


def test_embeddings_log_the_tokens_they_embedded(text_server):
    """OpenAI's ``usage``, Ollama's ``prompt_eval_count`` and the log line agree (the scripted backend counts
    words)."""
    client = openai.OpenAI(base_url=f"{text_server.url}/v1", api_key=BOOT, max_retries=0)
    raw = client.embeddings.with_raw_response.create(model="scripted", input=["a small cat", "a dog"])
    reply = raw.parse()
    assert (reply.usage.prompt_tokens, reply.usage.total_tokens) == (5, 5)
    line = logged(text_server, raw.headers["x-request-id"])
    assert (line["model"], line["prompt_tokens"], line["generated_tokens"]) == ("scripted", "5", "0"), line

    answer = httpx.post(
        f"{text_server.url}/api/embed",
        json={"model": "scripted", "input": "one two three"},
        headers={"authorization": f"Bearer {BOOT}"},
        timeout=30,
    )
    assert answer.status_code == 200 and answer.json()["prompt_eval_count"] == 3
    assert logged(text_server, answer.headers["x-request-id"])["prompt_tokens"] == "3"
