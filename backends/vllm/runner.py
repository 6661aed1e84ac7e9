"""The gateway's client for a vLLM head: vLLM's own OpenAI server, spoken to through ``protocols.openai_client``.

``generate`` posts the client-direction OpenAI request and streams the SSE body back as internal events; transport
failures are mapped by ``backends.runner.errors.mapped_transport_errors`` (once for every runner client) and end
the stream as ``Failed`` events (never raised): a refused connection or a server that dies mid-stream is
``BackendUnavailable``, a stalled one ``BackendTimeout``. Closing the iterator closes the HTTP
response, which makes vLLM abort the request. ``count_tokens`` uses vLLM's ``/tokenize`` (the chat template
applied, as the model reads it); there are no embeddings. Every call presents the cluster secret, which the
backend gave vLLM as its API key (``VLLM_API_KEY``); a 401 from vLLM (the two disagree) is a
``BackendProtocolError``, never the client's own authentication error.

A stream can be resumed (``Request.resume``) when its request is plain text: no response format, no tools, no log
probabilities. Such a request asks vLLM for ``return_token_ids``, so every delta carries its token ids. A resumed
one goes to ``/v1/completions`` with the token prompt the original had (the chat template applied by vLLM's own
``/tokenize``, as its chat endpoint applies it) followed by the tokens already sent, the same sampling (a seed moved
on by the tokens sent, as the other runners move it: sampled, the continuation is a valid one from that point, not
the undisturbed run's draw) and the tokens left of ``max_tokens``. vLLM cannot replay those tokens as events, so the
stream opens with one empty delta carrying them all (the gateway skips it), and the usage counts them as output, not
prompt. A response format or a forced tool call is not resumed: vLLM's grammar would start over at the continuation
(it cannot be given the tokens already generated), so such a stream fails mid-stream. A stop string that straddles
the tokens sent and those after them is not seen by the continuation.

Structured output is vLLM's own (llguidance, chosen by ``launch.STRUCTURED_OUTPUTS``): response formats and forced
tool calls pass through as OpenAI fields, after ``structured`` has refused, with the 400 the other runners
give, what would not be enforced.

Imports protocols, httpx, ``backends.runner.secret`` and ``backends.runner.errors`` only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec

from meshgate.backends.runner import secret as cluster_secret
from meshgate.backends.runner.errors import mapped_transport_errors, secret_refused
from meshgate.protocols.model import (
    BackendProtocolError,
    Embeddings,
    EmbedRequest,
    Event,
    Failed,
    Finished,
    GatewayError,
    Request,
    ResponseFormat,
    TextDelta,
    ToolChoice,
    UnsupportedFeature,
    Usage,
)
from meshgate.protocols.openai_client import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    StreamDecoder,
    chat_messages,
    error_from_response,
    request_body,
)
from meshgate.protocols.schema_rules import JSON_OPTIONS, check_schema, enforceable

__all__ = ["JSON_OPTIONS", "VllmRunner", "structured"]

_PEER = "vLLM"


class _Tokenized(msgspec.Struct):
    count: int
    tokens: list[int] = []


class VllmRunner:
    """Talks to one vLLM OpenAI server at ``base_url``, which serves the model as ``served_name``."""

    def __init__(
        self, base_url: str, served_name: str, http: httpx.AsyncClient, *, read_timeout: float = 300.0
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.served_name = served_name
        self.http = http
        self.timeout = httpx.Timeout(10.0, read=read_timeout)
        self.headers = {"content-type": "application/json", **cluster_secret.headers()}

    async def generate(self, request: Request) -> AsyncIterator[Event]:
        """Stream ``request``'s events; always ends in exactly one ``Finished`` or ``Failed``."""
        try:
            request = structured(request)
            if request.resume:
                path, body = await self._continuation(request)
            else:
                path = CHAT_PATH if request.raw_prompt is None else COMPLETIONS_PATH
                body = request_body(request, self.served_name)
                if _resumable(request):
                    body["return_token_ids"] = True
        except GatewayError as exc:
            yield _failed(exc)
            return
        resumed = len(request.resume)
        if resumed:
            yield TextDelta(text="", tokens=request.resume)  # what the client has, skipped by the gateway
            if request.max_tokens is not None and request.max_tokens <= resumed:
                yield Usage(prompt_tokens=len(body["prompt"]) - resumed, completion_tokens=resumed)
                yield Finished(reason="length")
                return
        async for event in self._stream(path, msgspec.json.encode(body)):
            if isinstance(event, Usage) and resumed:  # the tokens sent before were prompt to vLLM, output to us
                event = msgspec.structs.replace(
                    event,
                    prompt_tokens=event.prompt_tokens - resumed,
                    completion_tokens=event.completion_tokens + resumed,
                )
            yield event

    async def _stream(self, path: str, body: bytes) -> AsyncIterator[Event]:
        decoder = StreamDecoder()
        try:
            with mapped_transport_errors(_PEER):
                async with self.http.stream(
                    "POST", f"{self.base_url}{path}", content=body, timeout=self.timeout, headers=self.headers
                ) as response:
                    if response.status_code != 200:
                        yield _failed(
                            secret_refused(_PEER)
                            if response.status_code == 401
                            else error_from_response(response.status_code, await response.aread())
                        )
                        return
                    async for chunk in response.aiter_raw():
                        for event in decoder.feed(chunk):
                            yield event
                        if decoder.done:
                            return
        except GatewayError as exc:
            yield _failed(exc)
            return
        for event in decoder.close():
            yield event

    async def _continuation(self, request: Request) -> tuple[str, dict[str, Any]]:
        """The completions request that goes on from ``request.resume``: the original prompt's tokens, then those."""
        if not _resumable(request):
            raise UnsupportedFeature("vLLM cannot resume a stream with a response format, tools or log probabilities")
        prompt = (await self._tokenize(request)).tokens
        left = None if request.max_tokens is None else max(1, request.max_tokens - len(request.resume))
        body = request_body(
            msgspec.structs.replace(request, raw_prompt="", messages=(), max_tokens=left), self.served_name
        )
        body["prompt"] = [*prompt, *request.resume]
        body["return_token_ids"] = True
        if isinstance(body.get("seed"), int):  # drawn afresh after what was sent, as the other runners do
            body["seed"] = (body["seed"] + len(request.resume)) % 2**31
        return COMPLETIONS_PATH, body

    async def count_tokens(self, request: Request) -> int:
        """Tokens of ``request``'s prompt with the chat template applied (vLLM's ``/tokenize``)."""
        return (await self._tokenize(request)).count

    async def _tokenize(self, request: Request) -> _Tokenized:
        """``request``'s prompt as vLLM's chat (or completions) endpoint tokenizes it."""
        body: dict[str, object] = {"model": self.served_name}
        if request.raw_prompt is not None:
            body["prompt"] = request.raw_prompt
        else:
            body["messages"] = chat_messages(request.messages)
            if request.prefill and request.messages and request.messages[-1].role == "assistant":
                body["continue_final_message"] = True
                body["add_generation_prompt"] = False
            else:
                body["add_generation_prompt"] = True
            if request.tools:
                body["tools"] = [
                    {"type": "function", "function": {"name": t.name, "parameters": t.parameters}}
                    for t in request.tools
                ]
        with mapped_transport_errors(_PEER):
            response = await self.http.post(
                f"{self.base_url}/tokenize",
                content=msgspec.json.encode(body),
                headers=self.headers,
                timeout=self.timeout,
            )
        if response.status_code == 401:
            raise secret_refused(_PEER)
        if response.status_code != 200:
            raise error_from_response(response.status_code, response.content)
        try:
            return msgspec.json.decode(response.content, type=_Tokenized)
        except msgspec.DecodeError as exc:
            raise BackendProtocolError(f"vLLM sent an invalid token count: {exc}") from exc

    async def embed(self, request: EmbedRequest) -> Embeddings:
        raise UnsupportedFeature(
            f"model '{request.model}' does not support embeddings (vLLM serves it for generation)", param="model"
        )


# JSON_OPTIONS (protocols.schema_rules): llguidance's JSON options for a response format, as the llama.cpp and MLX
# runners use them. vLLM takes them from the schema's ``x-guidance`` (which overrides its server-wide defaults; a
# client's own ``x-guidance`` is replaced). Forced tool calls keep vLLM's compact JSON (``launch.STRUCTURED_OUTPUTS``),
# as the other runners write arguments.


STEPS = False
"""Whether schemas sent to vLLM get ``multipleOf`` steps (``schema_rules.enforceable``): not with the llguidance
vLLM 0.32 pins (1.7.6), whose ``multipleOf`` refuses every negative number."""


def structured(request: Request) -> Request:
    """``request`` as vLLM should get it, or a refusal of what vLLM would not hold generation to.

    Schemas are checked by ``protocols.schema_rules.check_schema`` (the keywords every runner enforces) and sent
    in the form llguidance reads (``enforceable``: OpenAPI's ``nullable``, bounded numbers, no ``multipleOf`` step
    added: ``STEPS``); ``json_object`` goes as the schema
    ``{"type": "object"}`` so that it is written the same way. Tools the model may call or not as it likes
    (``tool_choice`` ``auto``) are refused: vLLM reads such calls out of free text only with a per-model
    ``--tool-call-parser``, which we do not set. A forced call (``required`` or one named tool) is generated by
    vLLM under the tools' parameter schemas; ``required`` with a single tool goes as that tool named, the one
    answer ``required`` allows then, which vLLM holds to a single call (its ``required`` schema is an open list
    of calls: a small model may add calls until ``max_tokens``).

    Raises:
        InvalidRequest: (400) naming the keyword, or ``tool_choice``.
    """
    fmt, tools, choice = request.response_format, request.tools, request.tool_choice
    if fmt.kind != "text":
        schema: Any = fmt.schema if fmt.kind == "json_schema" else {"type": "object"}
        check_schema(schema, "the response format's JSON schema", param="response_format")
        held = {**enforceable(schema, steps=STEPS), "x-guidance": JSON_OPTIONS}
        fmt = ResponseFormat(kind="json_schema", schema=held, name=fmt.name)
    if tools and choice.mode == "auto":
        raise UnsupportedFeature(
            'vLLM models call tools only when the call is forced: set tool_choice to "required" or to one tool'
            ' (Anthropic: {"type": "any"} or {"type": "tool"}; Ollama: tools with a format)',
            param="tool_choice",
        )
    if tools and choice.mode != "none":
        forced = []
        for tool in tools:
            if choice.mode == "required" or tool.name == choice.name:
                check_schema(tool.parameters, f"tool {tool.name}'s parameters", param="tools")
                tool = msgspec.structs.replace(tool, parameters=enforceable(tool.parameters, steps=STEPS))
            forced.append(tool)
        tools = tuple(forced)
        if choice.mode == "required" and len(tools) == 1:
            choice = ToolChoice(mode="tool", name=tools[0].name, parallel=choice.parallel)
    return msgspec.structs.replace(request, response_format=fmt, tools=tools, tool_choice=choice)


def _resumable(request: Request) -> bool:
    """Whether a stream of ``request`` can go on from its tokens (see the module docstring)."""
    return request.response_format.kind == "text" and not request.tools and not request.logprobs


def _failed(err: GatewayError) -> Failed:
    return Failed(error=err.info())
