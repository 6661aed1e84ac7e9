"""``backends.runner.errors``: transport failures mapped once for every runner client, and the clients using it.

The clients are driven over ``httpx.MockTransport``, whose handler raises the failure under test where a real
connection would, so each mapping is exercised exactly (the real sockets are in ``test_runner_stream.py``).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from meshgate.backends.runner.client import RunnerClient
from meshgate.backends.runner.errors import mapped_transport_errors, secret_refused
from meshgate.backends.vllm.runner import VllmRunner
from meshgate.protocols.model import (
    BackendProtocolError,
    BackendTimeout,
    BackendUnavailable,
    EmbedRequest,
    Failed,
    GatewayError,
    InvalidRequest,
    Request,
)

REQUEST = Request(model="m", raw_prompt="hi", stream=True)
_URL = httpx.Request("POST", "http://runner/x")


@pytest.mark.parametrize(
    ("raised", "mapped", "message"),
    [
        (httpx.ReadTimeout("timed out", request=_URL), BackendTimeout, "vLLM did not answer in time (ReadTimeout)"),
        (httpx.ConnectTimeout("", request=_URL), BackendTimeout, "vLLM did not answer in time (ConnectTimeout)"),
        (httpx.ConnectError("refused", request=_URL), BackendUnavailable, "lost the connection to vLLM: refused"),
        (httpx.ReadError("", request=_URL), BackendUnavailable, "lost the connection to vLLM: ReadError"),
        (
            httpx.RemoteProtocolError("peer closed", request=_URL),
            BackendUnavailable,
            "lost the connection to vLLM: peer closed",
        ),
        (
            ConnectionRefusedError(111, "Connection refused"),
            BackendUnavailable,
            "lost the connection to vLLM: [Errno 111] Connection refused",
        ),
        (TimeoutError(), BackendTimeout, "no connection to vLLM within 2.5s"),
    ],
)
def test_each_transport_failure_maps_to_one_gateway_error(raised, mapped, message) -> None:
    with pytest.raises(mapped) as exc, mapped_transport_errors("vLLM", connect_timeout=2.5):
        raise raised
    assert exc.value.message == message
    assert exc.value.__cause__ is raised


def test_the_default_peer_is_the_model_runner_and_other_errors_pass() -> None:
    with pytest.raises(BackendTimeout, match="^no connection to the model runner in time$"), mapped_transport_errors():
        raise TimeoutError
    for other in [InvalidRequest("bad"), ValueError("x"), asyncio.CancelledError()]:
        with pytest.raises(type(other)) as exc, mapped_transport_errors():
            raise other
        assert exc.value is other


def test_a_refused_secret_is_a_protocol_error_naming_the_peer() -> None:
    err = secret_refused("vLLM")
    assert isinstance(err, BackendProtocolError) and err.message.startswith("vLLM refused this process's cluster")
    assert secret_refused().message.startswith("the model runner refused")


# ---------------------------------------------------------------------------------------------------- the clients


def _http(failure: Exception | int) -> httpx.AsyncClient:
    def handle(request: httpx.Request) -> httpx.Response:
        if isinstance(failure, Exception):
            raise failure
        return httpx.Response(failure, content=b"{}")

    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


async def test_vllm_stream_ends_in_failed_for_a_transport_failure() -> None:
    async with _http(httpx.ConnectError("refused", request=_URL)) as http:
        events = [e async for e in VllmRunner("http://vllm", "m", http).generate(REQUEST)]
    assert events == [Failed(error=BackendUnavailable("lost the connection to vLLM: refused").info())]


async def test_vllm_stream_ends_in_failed_for_a_refused_secret() -> None:
    async with _http(401) as http:
        [failed] = [e async for e in VllmRunner("http://vllm", "m", http).generate(REQUEST)]
    assert isinstance(failed, Failed) and failed.error == secret_refused("vLLM").info()


async def test_vllm_count_tokens_raises_the_mapped_error() -> None:
    async with _http(httpx.ReadTimeout("", request=_URL)) as http:
        with pytest.raises(BackendTimeout, match=r"vLLM did not answer in time \(ReadTimeout\)"):
            await VllmRunner("http://vllm", "m", http).count_tokens(REQUEST)


@pytest.mark.parametrize(
    ("failure", "mapped"),
    [
        (httpx.WriteError("broken pipe", request=_URL), BackendUnavailable),
        (httpx.PoolTimeout("", request=_URL), BackendTimeout),
        (401, BackendProtocolError),
    ],
)
async def test_runner_client_unary_calls_raise_the_mapped_error(failure, mapped) -> None:
    async with _http(failure) as http:
        client = RunnerClient("http://runner", http, secret="s")
        with pytest.raises(mapped) as exc:
            await client.embed(EmbedRequest(model="m", inputs=("a",)))
    assert isinstance(exc.value, GatewayError)
    if failure == 401:
        assert exc.value.message == secret_refused().message
