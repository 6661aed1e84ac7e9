"""Telemetry in-process: the request log's formats, the cheap instruments, the dispatcher filling a request's
record, and the gateway's and the agent's registries read back with ``prometheus_client``'s own parser."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshgate.gateway.http.runtime import control_plane
from meshgate.gateway.telemetry import middleware
from meshgate.gateway.telemetry.instruments import Counter, Histogram, Instruments, exposition
from meshgate.gateway.telemetry.logs import Fields, JsonFormatter, LineHandler, TextFormatter, logfmt
from meshgate.gateway.telemetry.metrics import GatewayMetrics
from meshgate.gateway.telemetry.middleware import REPORT_DELAY, RequestTelemetry, _reason, protocol_of
from meshgate.gateway.telemetry.record import RequestRecord, bind, unbind
from meshgate.plugins.manager import build_plugin_manager
from meshgate.plugins.settings import Settings
from meshgate.protocols.model import Message, Request, TextPart, UnknownModel, collect
from tests import scripted_plugin


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, by (name, sorted labels)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_logfmt_quotes_what_is_not_a_plain_word_and_always_the_error():
    line = logfmt({"id": "req_1", "path": "/a b", "model": None, "status": 404, "error": "Forbidden", "x": 'q"\n'})
    assert line == 'id=req_1 path="/a b" model=- status=404 error="Forbidden" x="q\\"\\n"'


def test_json_lines_carry_the_same_keys_after_time_level_logger_message():
    formatter = JsonFormatter()
    fields = Fields("request", {"id": "req_1", "status": 200, "model": None})
    record = logging.LogRecord("meshgate.requests", logging.INFO, __file__, 1, fields, None, None)
    out = json.loads(formatter.format(record))
    assert list(out) == ["time", "level", "logger", "message", "id", "status", "model"]
    assert out["message"] == "request" and out["status"] == 200 and out["model"] is None
    assert str(fields) == "request id=req_1 status=200 model=-"
    plain = logging.LogRecord("meshgate", logging.WARNING, __file__, 1, "a %s", ("b",), None)
    assert json.loads(formatter.format(plain))["message"] == "a b"


def test_protocols_and_error_reasons():
    assert protocol_of("/v1/messages", []) == "anthropic"
    assert protocol_of("/v1/models", [(b"anthropic-version", b"2023-06-01")]) == "anthropic"
    assert protocol_of("/v1/models", []) == protocol_of("/chat/completions", []) == "openai"
    assert protocol_of("/api/chat", []) == protocol_of("/", []) == "ollama"
    assert protocol_of("/instances/x", []) == "cluster" and protocol_of("/metrics", []) == "other"
    assert _reason(b'{"error":{"message":"bad key","type":"x"}}', 401) == "bad key"
    assert _reason(b'{"type":"error","error":{"type":"t","message":"no model"}}', 404) == "no model"
    assert _reason(b'{"error":"ollama says no"}', 400) == "ollama says no"
    assert _reason(b"", 503) == "Service Unavailable"


def test_a_histogram_observed_in_bulk_exports_cumulative_buckets():
    itl = Histogram("t_seconds", "d", ("model",), (0.01, 0.1))
    itl.observe(("m",), 0.05, 9)  # one stream: 10 tokens, 9 gaps of 50 ms on average
    itl.observe(("m",), 0.01)  # on the bound: le is inclusive
    hits = Counter("t_hits_total", "d", ("a",))
    hits.inc(("x",))
    registry_text, content_type = exposition(_registry(Instruments([itl, hits])), "")
    got = samples(registry_text.decode())
    assert content_type.startswith("text/plain; version=0.0.4")
    assert got[("t_seconds_bucket", (("le", "0.01"), ("model", "m")))] == 1
    assert got[("t_seconds_bucket", (("le", "0.1"), ("model", "m")))] == 10
    assert got[("t_seconds_bucket", (("le", "+Inf"), ("model", "m")))] == 10
    assert got[("t_seconds_count", (("model", "m"),))] == 10
    assert got[("t_seconds_sum", (("model", "m"),))] == pytest.approx(0.46)
    assert got[("t_hits_total", (("a", "x"),))] == 1


def _registry(collector):
    from prometheus_client.registry import CollectorRegistry

    registry = CollectorRegistry()
    registry.register(collector)
    return registry


def _request(text: str, model: str = "scripted", **extra) -> Request:
    return Request(model=model, messages=(Message(role="user", parts=(TextPart(text=text),)),), **extra)


@pytest.fixture
async def plane(tmp_path):
    settings = Settings(data_dir=str(tmp_path), disabled_plugins=("llama_cpp", "mlx", "vllm"), agent_port=0)
    async with control_plane(
        settings, build_plugin_manager(settings, extra=[scripted_plugin]), gateway=True, agent=True
    ) as plane:
        yield plane


async def test_the_dispatcher_fills_the_request_record_and_the_gateway_counts_it(plane):
    record = RequestRecord("req_test")
    token = bind(record)
    try:
        response = await collect(await plane.dispatcher.open_stream(_request("hello")))
    finally:
        unbind(token)
    instance = (await plane.store.instances())[0]
    assert (record.asked, record.model, record.instance) == ("scripted", "scripted", instance.id)
    assert (
        (record.prompt_tokens, record.generated_tokens)
        == (7, 2)
        == (
            response.usage.prompt_tokens,
            response.usage.completion_tokens,
        )
    )
    assert record.started < record.first_token_at <= record.ended_at and record.error is None

    other = RequestRecord("req_other")
    token = bind(other)
    try:
        with pytest.raises(UnknownModel):
            await plane.dispatcher.open_stream(_request("hello", model="made-up"))
    finally:
        unbind(token)
    assert (other.asked, other.model, other.instance) == ("made-up", None, None)

    one, two = GatewayMetrics(), GatewayMetrics()  # two apps in one process: separate registries
    one.observe(record, "openai", "/v1/chat/completions", "scripted", "200", record.ended_at + 0.001)
    await one.refresh(plane)
    await two.refresh(plane)
    got = samples(exposition(one.registry, "")[0].decode())
    assert got[("meshgate_requests_total", _labels(endpoint="/v1/chat/completions", model="scripted"))] == 1
    assert got[("meshgate_generated_tokens_total", (("instance", instance.id), ("model", "scripted")))] == 2
    assert got[("meshgate_inter_token_latency_seconds_count", (("model", "scripted"),))] == 1
    assert got[("meshgate_instances", (("state", "ready"),))] == 1
    assert got[("meshgate_active_sequences", (("instance", instance.id),))] == 0
    node = plane.agent.name
    assert got[("meshgate_node_memory_bytes", (("kind", "used"), ("node", node)))] > 0
    assert ("meshgate_requests_total", _labels(endpoint="/v1/chat/completions", model="scripted")) not in samples(
        exposition(two.registry, "")[0].decode()
    )


def _labels(**changes: str) -> tuple[tuple[str, str], ...]:
    labels = {"protocol": "openai", "endpoint": "", "model": "", "status": "200", **changes}
    return tuple(sorted(labels.items()))


async def test_the_agent_serves_its_metrics_to_the_cluster_secret_only(plane):
    agent = plane.agent
    agent.metrics.restarted("scripted")
    async with httpx.AsyncClient(base_url=agent.agent_url, trust_env=False) as http:
        assert (await http.get("/metrics")).status_code == 401
        answer = await http.get("/metrics", headers={"authorization": f"Bearer {agent.secret}"})
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    got = samples(answer.text)
    assert got[("meshgate_runner_restarts_total", (("model", "scripted"), ("node", agent.name)))] == 1
    assert got[("meshgate_node_cores", (("node", agent.name),))] >= 1
    assert got[("meshgate_node_memory_bytes", (("kind", "offered"), ("node", agent.name)))] > 0
    assert "process_cpu_seconds_total" in {name for name, _ in got}


def test_settings_switch_the_format_and_the_metrics_off(tmp_path):
    from meshgate.gateway.http.app import create_app

    settings = Settings.from_env(
        {"MESHGATE_LOG_FORMAT": "json", "MESHGATE_METRICS": "0"}, data_dir=str(tmp_path), disabled_plugins=("mlx",)
    )
    assert (settings.log_format, settings.metrics) == ("json", False)
    off = create_app(settings, build_plugin_manager(settings))
    on = create_app(settings.replace(metrics=True), build_plugin_manager(settings))
    assert "/metrics" not in {route.path for route in off.routes} and off.state.metrics is None
    assert "/metrics" in {route.path for route in on.routes} and on.state.metrics.registry is not None


class _Writes(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)


async def test_finished_requests_are_logged_and_counted_in_batches(monkeypatch):
    stream = _Writes()
    handler = LineHandler(stream)
    handler.setFormatter(TextFormatter())
    monkeypatch.setattr(logging.getLogger(), "handlers", [handler])
    monkeypatch.setattr(logging.getLogger(), "level", logging.INFO)
    logging.Logger.manager._clear_cache()  # loggers cache isEnabledFor: an earlier test's answer must not stick

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b'{"error": {"message": "no such thing"}}'})

    async def ignore(_message) -> None:
        pass

    metrics = GatewayMetrics()
    telemetry = RequestTelemetry(app, None, metrics)
    for path in ("/v1/one", "/v1/two", "/v1/three"):
        scope = {"type": "http", "method": "GET", "path": path, "headers": [], "state": {}}
        await telemetry(scope, None, ignore)
    assert stream.getvalue() == "" and not metrics.requests.values  # nothing reported on the request's path
    await asyncio.sleep(REPORT_DELAY)
    for _ in range(200):  # the batch goes out by itself, once its delay is over (a loaded machine runs it late)
        if stream.writes:
            break
        await asyncio.sleep(0.05)
    lines = stream.getvalue().splitlines()
    assert [line.split(" path=")[1].split()[0] for line in lines] == ["/v1/one", "/v1/two", "/v1/three"]
    assert all(line.endswith('error="no such thing"') for line in lines) and stream.writes == 1
    assert sum(metrics.requests.values.values()) == 3

    await telemetry({"type": "http", "method": "GET", "path": "/v1/four", "headers": [], "state": {}}, None, ignore)
    telemetry.flush()  # a scrape or a stop does not wait for the batch
    assert "path=/v1/four" in stream.getvalue() and sum(metrics.requests.values.values()) == 4

    monkeypatch.setattr(middleware, "REPORT_MAX", 2)  # a full batch goes out at once
    for path in ("/v1/six", "/v1/seven"):
        await telemetry({"type": "http", "method": "GET", "path": path, "headers": [], "state": {}}, None, ignore)
    assert "path=/v1/seven" in stream.getvalue() and sum(metrics.requests.values.values()) == 6

    seen: list[logging.LogRecord] = []
    handler.addFilter(lambda record: seen.append(record) or True)  # logging as configured otherwise: one record each
    await telemetry({"type": "http", "method": "GET", "path": "/v1/five", "headers": [], "state": {}}, None, ignore)
    ended = time.time()
    await asyncio.sleep(0.2)
    telemetry.flush()
    assert seen and abs(seen[0].created - ended) < 0.1  # the record's time is the request's end, not the batch's
    assert [str(r.msg).split(" path=")[1].split()[0] for r in seen] == ["/v1/five"] and stream.writes == 4


def test_a_line_made_for_a_batch_reads_as_the_record_would():
    fields = Fields("request", {"id": "req_1", "path": "/v1/x y", "status": 200, "error": None})
    record = logging.LogRecord("meshgate.requests", logging.INFO, "", 0, fields, (), None)
    for formatter in (TextFormatter(), JsonFormatter()):
        handler = LineHandler(io.StringIO())
        handler.setFormatter(formatter)
        assert handler.line(record.created, "INFO", "meshgate.requests", fields) == formatter.format(record)


def test_a_broken_log_stream_is_reported_not_raised(monkeypatch):
    class Broken(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError("the disk is full")

    reported: list[logging.LogRecord] = []
    handler = LineHandler(Broken())
    monkeypatch.setattr(handler, "handleError", reported.append)
    handler.write_lines(["a line", "another"])
    assert [r.name for r in reported] == ["meshgate.requests"]
