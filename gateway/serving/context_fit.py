"""Context checks before the queue: does a request's prompt (and the output it asks for) fit the instance?

Each protocol's own rule (``Fit``), applied by the dispatcher before a request may wait for a slot:

- ``PROMPT_AND_OUTPUT`` (OpenAI): the prompt plus ``max_tokens`` must fit the context; without ``max_tokens`` the
  prompt must leave room for one token of output.
- ``PROMPT`` (Anthropic; Ollama's ``/api/generate``, and ``/api/chat`` with ``truncate: false``): only the prompt
  is checked, leaving room for one token; the output is capped by the room left (the runner does that).
  Anthropic clients routinely send ``max_tokens`` far beyond a small context (Claude Code asks for 32000).
- ``DROP_OLDEST`` (Ollama's ``/api/chat``): as Ollama's ``chatPrompt`` does, drop the oldest messages (keeping
  every system message, the latest message, and the assistant call a tool result answers) until the prompt fits.

What cannot fit is ``ContextLengthExceeded``, each protocol rendering its own words. Before any of that, the output
asked for is held to the gateway's ``max_tokens`` setting (``cap_output``): refused as ``OutputTooLarge`` (OpenAI,
Anthropic) or cut to it (Ollama's ``num_predict``); after it, a request that asks for no limit gets that one when
the context would allow more. Ollama goes on to cut a prompt
that still does not fit inside its runner (keeping its first ``num_keep`` tokens and its end); that is not
done here, such a prompt is refused as Ollama refuses it with ``truncate: false``.

The count is the runner's own (its ``/tokenize``, template and tools included). A request is not counted at all
when its bytes already bound its tokens well inside the context: every token of a prompt stands for at least one
byte of its rendered text, so the UTF-8 size of the messages plus a generous allowance for the chat template
(role markers, a template's default system text) is an upper bound. Requests with tools or images (rendered by
the backend at sizes the gateway cannot bound) are always counted; a backend that cannot count
(``UnsupportedFeature``) leaves the check to its runner. The other way round, a prompt's bytes over the most bytes
one of the model's tokens stands for (``Backend.token_bytes``) is a lower bound: a prompt that cannot fit by that
bound alone (1 MB of text for a 4,096-token context) is refused without being counted, so it costs the runner
nothing; its error names that lower bound as the prompt's tokens.

Imports ``protocols.model`` only; the count is passed in.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Sequence

import msgspec

from meshgate.protocols.model import (
    ContextLengthExceeded,
    ImagePart,
    Message,
    OutputTooLarge,
    ReasoningPart,
    Request,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    UnsupportedFeature,
)

__all__ = ["GROWTH_ROOM", "Fit", "cap_output", "fit_context", "grown_context", "needed_context", "token_bound"]

Count = Callable[[Request], Awaitable[int]]

TEMPLATE_BYTES = 1024
"""Allowance for what a chat template adds once: BOS, a default system text, the generation prompt."""

TURN_BYTES = 64
"""Allowance for what a chat template adds per message (role markers, separators, ``Result of <tool>:``)."""


GROWTH_ROOM = 1024
"""Tokens of output a request that gets a bigger context (``needed_context``) is given room for at least."""


class Fit(enum.Enum):
    """How a protocol wants a request checked against the context (see the module docstring)."""

    PROMPT_AND_OUTPUT = "prompt_and_output"
    PROMPT = "prompt"
    DROP_OLDEST = "drop_oldest"


async def fit_context(request: Request, context: int, count: Count, fit: Fit, token_bytes: int = 0) -> Request:
    """``request`` as it will run (for ``DROP_OLDEST``, maybe without its oldest messages).

    Args:
        request: The request.
        context: Tokens the instance holds per sequence; 0 or less when unknown (nothing is checked).
        count: The runner's token count for a request.
        fit: The protocol's rule.
        token_bytes: The most bytes one token stands for (``Backend.token_bytes``; 0: unknown). A prompt whose
            bytes alone show it cannot fit is refused without counting, unless
            ``DROP_OLDEST`` may still make it fit.

    Raises:
        ContextLengthExceeded: it does not fit.
        GatewayError: counting failed (``BackendUnavailable`` when the runner cannot be reached).
    """
    if context <= 0:
        return request
    output = request.max_tokens if fit is Fit.PROMPT_AND_OUTPUT else None
    room = output or 1
    bound, text = _sizes(request)
    if bound is not None and bound + room <= context:
        return request
    least = text // token_bytes if token_bytes > 0 else 0
    if least + room > context and not (fit is Fit.DROP_OLDEST and len(request.messages) > 1):
        raise ContextLengthExceeded(prompt_tokens=least, completion_tokens=output, context=context)
    try:
        prompt = await count(request)
    except UnsupportedFeature:
        return request
    if prompt + room <= context:
        return request
    if fit is Fit.DROP_OLDEST and len(request.messages) > 1:
        trimmed = await _drop_oldest(request, context, count)
        if trimmed is not None:
            return trimmed
    raise ContextLengthExceeded(prompt_tokens=prompt, completion_tokens=output, context=context)


async def needed_context(
    request: Request, context: int, limit: int, count: Count, fit: Fit, token_bytes: int = 0
) -> int:
    """Tokens of context ``request`` needs whole (no message dropped) when it does not fit ``context`` but could
    fit ``limit`` (the model's own); 0 otherwise (it fits, or nothing up to ``limit`` would hold it).

    What it needs is its prompt plus the output it asks for (``PROMPT_AND_OUTPUT``) and at least ``GROWTH_ROOM``
    tokens of output. Counts the same way as ``fit_context``, which the caller runs next on the context it picks.
    """
    if context <= 0 or limit <= context:
        return 0
    room = (request.max_tokens if fit is Fit.PROMPT_AND_OUTPUT else None) or 1
    bound, text = _sizes(request)
    if bound is not None and bound + room <= context:
        return 0
    least = text // token_bytes if token_bytes > 0 else 0
    if least + room > limit:
        return 0
    try:
        prompt = await count(request)
    except UnsupportedFeature:
        return 0
    if prompt + room <= context or prompt + room > limit:
        return 0
    return prompt + max(room, GROWTH_ROOM)


def grown_context(context: int, needed: int, limit: int) -> int:
    """The context a request that needs ``needed`` tokens gets: ``context`` doubled until it holds them, at most
    ``limit`` (so requests of similar sizes share a replica instead of each getting its own)."""
    size = max(context, 1)
    while size < needed:
        size *= 2
    return min(size, limit)


def cap_output(request: Request, limit: int, *, clamp: bool, context: int = 0) -> Request:
    """``request`` with ``max_tokens`` at most ``limit``: cut to it when ``clamp``, else refused.

    ``None`` (no limit asked for: the runner stops at the end of the context) becomes ``limit`` when that is the
    tighter bound, i.e. below the instance's ``context`` (0: unknown, left as it is). Only do that once the prompt
    was checked against the context (``fit_context``), which reads ``max_tokens`` as the output asked for.

    Raises:
        OutputTooLarge: ``max_tokens`` is above ``limit`` and ``clamp`` is false.
    """
    if request.max_tokens is None:
        return msgspec.structs.replace(request, max_tokens=limit) if 0 < limit < context else request
    if request.max_tokens <= limit:
        return request
    if not clamp:
        raise OutputTooLarge(asked=request.max_tokens, limit=limit, model=request.model)
    return msgspec.structs.replace(request, max_tokens=limit)


def token_bound(request: Request) -> int | None:
    """An upper bound on the prompt's tokens from its bytes alone; ``None`` with tools or images."""
    return _sizes(request)[0]


def _sizes(request: Request) -> tuple[int | None, int]:
    """(``token_bound``, the UTF-8 bytes of the prompt's text alone)."""
    if request.raw_prompt is not None:
        text = len(request.raw_prompt.encode())
        return (None if request.tools else TEMPLATE_BYTES + text), text
    text, extra, bounded = 0, TEMPLATE_BYTES, not request.tools
    for message in request.messages:
        extra += TURN_BYTES
        for part in message.parts:
            match part:
                case TextPart(text=content) | ReasoningPart(text=content):
                    text += len(content.encode())
                case ToolCallPart(name=name, arguments=arguments):
                    extra += TURN_BYTES + len(name.encode())
                    text += len(arguments.encode())
                case ToolResultPart(name=name, content=content):
                    bounded = bounded and not any(isinstance(c, ImagePart) for c in content)
                    extra += TURN_BYTES + len((name or "").encode())
                    text += sum(len(c.text.encode()) for c in content if isinstance(c, TextPart))
                case _:  # an image
                    bounded = False
    return (text + extra if bounded else None), text


async def _drop_oldest(request: Request, context: int, count: Count) -> Request | None:
    """The request without the fewest oldest messages that makes it fit; ``None`` if keeping only the system
    messages and the latest turn still does not.

    Dropping more never makes a prompt longer, so the first start that fits is found by bisection.
    """
    messages = request.messages
    last = len(messages) - 1

    def starting_at(i: int) -> Request:
        start = _turn_start(messages, i)
        kept = tuple(m for m in messages[:start] if m.role == "system") + messages[start:]
        return msgspec.structs.replace(request, messages=kept)

    async def fits(i: int) -> bool:
        return await count(starting_at(i)) + 1 <= context

    if not await fits(last):
        return None
    low, high = 1, last
    while low < high:
        middle = (low + high) // 2
        if await fits(middle):
            high = middle
        else:
            low = middle + 1
    return starting_at(low)


def _turn_start(messages: Sequence[Message], i: int) -> int:
    """Where a conversation kept from message ``i`` must start so a tool result keeps the call it answers
    (Ollama's ``toolBlockStartIndex``)."""
    if messages[i].role != "tool":
        return i
    start = i
    while start > 0 and messages[start - 1].role == "tool":
        start -= 1
    calls = (
        start > 0
        and messages[start - 1].role == "assistant"
        and any(isinstance(p, ToolCallPart) for p in messages[start - 1].parts)
    )
    return start - 1 if calls else i
