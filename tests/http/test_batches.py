"""Batch jobs in process with the official SDKs and the scripted backend: OpenAI's files + batches, Anthropic's
message batches, bad lines, cancel, pagination (``gateway.batches``, ``gateway.http.routes.batches``)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging

import anthropic
import httpx
import openai
import pytest
import uvicorn

from meshgate.gateway.http.app import create_app
from meshgate.plugins.manager import build_plugin_manager
from meshgate.plugins.settings import Settings
from tests import scripted_plugin
from tests.conftest import free_port


@pytest.fixture
async def http(tmp_path):
    """The app with the scripted backend, served by uvicorn on a loopback port in this event loop (the Anthropic
    SDK takes no ASGI transport)."""
    settings = Settings(
        data_dir=str(tmp_path), disabled_plugins=("llama_cpp", "mlx", "vllm"), agent_port=0, batch_concurrency=2
    )
    app = create_app(settings, build_plugin_manager(settings, extra=[scripted_plugin]))
    async with serving(app) as url:
        oai = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        ant = anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0)
        yield oai, ant
        await oai.close()
        await ant.close()
    logging.getLogger().manager._clear_cache()  # see tests/serving/test_tiers.py


@contextlib.asynccontextmanager
async def serving(app):
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        await task


def _jsonl(*lines: dict) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def _chat(custom_id: str, text: str, **extra) -> dict:
    body = {"model": "scripted", "messages": [{"role": "user", "content": text}], **extra}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


async def _until(check, timeout: float = 20.0):
    for _ in range(int(timeout / 0.05)):
        found = await check()
        if found:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError("timed out")


async def test_openai_files_batches_and_the_output_and_error_files(http):
    oai, _ = http
    content = _jsonl(
        _chat("a", "hello"),
        _chat("b", "one two three"),
        _chat("bad", "hello", temperature=5),  # refused as the endpoint refuses it: it fails alone
        _chat("gone", "hello", model="no-such-model"),
    )
    uploaded = await oai.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    assert (uploaded.purpose, uploaded.bytes, uploaded.filename) == ("batch", len(content), "in.jsonl")
    assert (await oai.files.retrieve(uploaded.id)).id == uploaded.id
    batch = await oai.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"run": "1"}
    )
    assert batch.status in ("validating", "in_progress") and batch.request_counts.total == 4

    async def ended():
        found = await oai.batches.retrieve(batch.id)
        return found if found.status == "completed" else None

    done = await _until(ended)
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 2)
    assert done.metadata == {"run": "1"} and done.completed_at and done.in_progress_at and done.finalizing_at
    output = [json.loads(line) for line in (await oai.files.content(done.output_file_id)).text.splitlines()]
    by_id = {line["custom_id"]: line for line in output}
    assert by_id["a"]["response"]["status_code"] == 200 and by_id["a"]["error"] is None
    answer = by_id["a"]["response"]["body"]
    assert answer["choices"][0]["message"]["content"] == "Hello, world" and answer["service_tier"] == "flex"
    assert by_id["b"]["response"]["body"]["choices"][0]["message"]["content"].strip() == "one two three"
    errors = {
        json.loads(line)["custom_id"]: json.loads(line)
        for line in (await oai.files.content(done.error_file_id)).text.splitlines()
    }
    assert errors["bad"]["response"]["status_code"] == 400
    assert "temperature" in errors["bad"]["response"]["body"]["error"]["message"]
    assert errors["gone"]["response"]["status_code"] == 404
    assert set(by_id) | set(errors) == {"a", "b", "bad", "gone"}
    listed = await oai.batches.list(limit=1)
    assert [b.id for b in listed.data] == [batch.id]
    files = [f.id async for f in oai.files.list()]
    assert uploaded.id in files and done.output_file_id in files
    assert (await oai.files.delete(uploaded.id)).deleted
    with pytest.raises(openai.NotFoundError):
        await oai.files.retrieve(uploaded.id)


async def test_a_malformed_file_is_refused_with_the_line_to_fix(http):
    oai, _ = http
    with pytest.raises(openai.BadRequestError) as refused:
        await oai.files.create(file=("x.jsonl", io.BytesIO(_jsonl(_chat("a", "hi")) + b"{not json\n")), purpose="batch")
    assert "line 2" in refused.value.message
    with pytest.raises(openai.BadRequestError) as twice:
        await oai.files.create(
            file=("x.jsonl", io.BytesIO(_jsonl(_chat("a", "hi"), _chat("a", "ho")))), purpose="batch"
        )
    assert "line 2" in twice.value.message and "custom_id" in twice.value.message
    chat = await oai.files.create(file=("x.jsonl", io.BytesIO(_jsonl(_chat("a", "hi")))), purpose="batch")
    with pytest.raises(openai.BadRequestError) as wrong:
        await oai.batches.create(input_file_id=chat.id, endpoint="/v1/embeddings", completion_window="24h")
    assert "line 1" in wrong.value.message and "/v1/embeddings" in wrong.value.message
    with pytest.raises(openai.NotFoundError):
        await oai.batches.retrieve("batch_nope")


async def test_cancel_stops_the_lines_not_started(http):
    oai, ant = http
    lines = [_chat(f"l{i}", "sleep 0.3") for i in range(8)]
    uploaded = await oai.files.create(file=("in.jsonl", io.BytesIO(_jsonl(*lines))), purpose="batch")
    batch = await oai.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    await asyncio.sleep(0.2)
    cancelling = await oai.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at

    async def ended():
        found = await oai.batches.retrieve(batch.id)
        return found if found.status == "cancelled" else None

    done = await _until(ended)
    assert 0 < done.request_counts.completed < 8, "the running lines finished, the others did not start"
    errors = [json.loads(line) for line in (await oai.files.content(done.error_file_id)).text.splitlines()]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert done.request_counts.completed + len(errors) == 8


async def test_anthropic_message_batches(http):
    _, ant = http
    made = await ant.messages.batches.create(
        requests=[
            {
                "custom_id": "one",
                "params": {"model": "scripted", "max_tokens": 16, "messages": [{"role": "user", "content": "hello"}]},
            },
            {"custom_id": "two", "params": {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}},
        ]
    )
    assert made.processing_status == "in_progress" and made.request_counts.processing == 2

    async def ended():
        found = await ant.messages.batches.retrieve(made.id)
        return found if found.processing_status == "ended" else None

    done = await _until(ended)
    assert (done.request_counts.succeeded, done.request_counts.errored) == (1, 1) and done.results_url
    results = {r.custom_id: r.result async for r in await ant.messages.batches.results(made.id)}
    assert results["one"].type == "succeeded" and results["one"].message.content[0].text == "Hello, world"
    assert results["one"].message.usage.service_tier == "batch"
    assert results["two"].type == "errored" and results["two"].error.error.type == "invalid_request_error"
    assert "max_tokens" in results["two"].error.error.message
    page = await ant.messages.batches.list(limit=10)
    assert made.id in [b.id for b in page.data]
    assert (await ant.messages.batches.delete(made.id)).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        await ant.messages.batches.retrieve(made.id)
    with pytest.raises(anthropic.BadRequestError) as twice:
        await ant.messages.batches.create(requests=[{"custom_id": "x", "params": {}}, {"custom_id": "x", "params": {}}])
    assert "requests[1].custom_id" in twice.value.message


async def test_an_anthropic_batch_cancelled_reports_canceled_lines(http):
    _, ant = http
    params = {"model": "scripted", "max_tokens": 8, "messages": [{"role": "user", "content": "sleep 0.3"}]}
    made = await ant.messages.batches.create(requests=[{"custom_id": f"r{i}", "params": params} for i in range(6)])
    await asyncio.sleep(0.1)
    assert (await ant.messages.batches.cancel(made.id)).processing_status in ("canceling", "ended")

    async def ended():
        found = await ant.messages.batches.retrieve(made.id)
        return found if found.processing_status == "ended" else None

    done = await _until(ended)
    assert done.request_counts.canceled > 0 and done.request_counts.canceled + done.request_counts.succeeded == 6
    kinds = [r.result.type async for r in await ant.messages.batches.results(made.id)]
    assert set(kinds) <= {"succeeded", "canceled"} and len(kinds) == 6


async def test_batch_lines_are_logged_and_counted_at_the_batch_class(http, caplog):
    oai, ant = http
    url = str(oai.base_url).removesuffix("/v1/")
    content = _jsonl(_chat("a", "hello"), _chat("gone", "hello", model="no-such-model"))
    uploaded = await oai.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    with caplog.at_level(logging.INFO, logger="meshgate.requests"):
        batch = await oai.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )

        async def ended():
            found = await oai.batches.retrieve(batch.id)
            return found if found.status == "completed" else None

        await _until(ended)
        async with httpx.AsyncClient(base_url=url) as client:
            metrics = (await client.get("/metrics")).text  # a scrape reports what is pending first
    assert 'meshgate_class_requests_total{class="batch",model="scripted"} 1.0' in metrics
    assert (
        'meshgate_requests_total{endpoint="/v1/chat/completions",model="scripted",protocol="openai",status="200"} 1.0'
        in metrics
    )
    assert 'status="404"' in metrics
    logged = [r.getMessage() for r in caplog.records if r.name == "meshgate.requests"]
    lines = [line for line in logged if f"batch={batch.id}" in line]
    assert len(lines) == 2, lines
    assert any("class=batch" in line and "status=200" in line and "generated_tokens=" in line for line in lines)
    assert any("status=404" in line and "error=" in line for line in lines)
