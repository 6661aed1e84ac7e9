"""The fair queue (``gateway.serving.admission``) and the context rules (``gateway.serving.context_fit``), in
process."""

from __future__ import annotations

import asyncio

import pytest

from meshgate.gateway.serving.admission import Admission, Load
from meshgate.gateway.serving.context_fit import Fit, fit_context, grown_context, needed_context, token_bound
from meshgate.protocols.model import (
    ContextLengthExceeded,
    ImagePart,
    Message,
    Overloaded,
    Request,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    UnsupportedFeature,
)

# ------------------------------------------------------------------------------------------------- admission


async def test_slots_then_queue_then_overloaded():
    admission = Admission(parallel=2, max_queue=1)
    first, second = admission.enter("i", "a"), admission.enter("i", "b")
    third = admission.enter("i", "c")
    assert (first.granted, second.granted, third.granted) == (True, True, False)
    assert admission.load("i") == Load(active=2, queued=1, parallel=2, max_queue=1)
    with pytest.raises(Overloaded) as refused:
        admission.enter("i", "d")
    assert refused.value.retry_after >= 1
    assert admission.load("other") == Load(active=0, queued=0, parallel=2, max_queue=1), "gates are per instance"
    first.release()
    await asyncio.wait_for(third.wait(), 1)
    assert third.granted and admission.load("i") == Load(active=2, queued=0, parallel=2, max_queue=1)


async def test_release_twice_frees_one_slot():
    admission = Admission(parallel=1, max_queue=4)
    running = admission.enter("i", "a")
    waiting = [admission.enter("i", "a") for _ in range(2)]
    running.release()
    running.release()
    assert [t.granted for t in waiting] == [True, False]
    assert admission.load("i").active == 1


async def test_round_robin_across_callers():
    """Caller a queues five, b one: b's request is served second, not sixth."""
    admission = Admission(parallel=1, max_queue=10)
    running = admission.enter("i", "a")
    order = []

    async def request(caller: str, name: str) -> None:
        ticket = admission.enter("i", caller)
        await ticket.wait()
        order.append(name)
        await asyncio.sleep(0)
        ticket.release()

    tasks = [asyncio.create_task(request("a", f"a{n}")) for n in range(5)]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(request("b", "b0")))
    await asyncio.sleep(0)
    assert admission.load("i").queued == 6
    running.release()
    await asyncio.wait_for(asyncio.gather(*tasks), 2)
    assert order == ["a0", "b0", "a1", "a2", "a3", "a4"]


async def test_fewest_running_goes_first():
    """With two requests of a still running, the next free slot goes to b although a queued first."""
    admission = Admission(parallel=3, max_queue=10)
    held = [admission.enter("i", "a") for _ in range(3)]
    a_waits, b_waits = admission.enter("i", "a"), admission.enter("i", "b")
    held[0].release()
    assert (a_waits.granted, b_waits.granted) == (False, True)
    held[1].release()
    assert a_waits.granted


async def test_cancelled_waiter_leaves_the_queue():
    admission = Admission(parallel=1, max_queue=2)
    running = admission.enter("i", "a")
    ticket = admission.enter("i", "b")
    waiter = asyncio.create_task(ticket.wait())
    await asyncio.sleep(0)
    assert admission.load("i").queued == 1
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert admission.load("i") == Load(active=1, queued=0, parallel=1, max_queue=2)
    running.release()
    assert admission.load("i").active == 0, "nobody left to grant"


async def test_granted_then_cancelled_frees_the_slot():
    """Cancelled after its turn came but before it ran: the slot goes to the next one."""
    admission = Admission(parallel=1, max_queue=2)
    running = admission.enter("i", "a")
    ticket, after = admission.enter("i", "b"), admission.enter("i", "c")
    waiter = asyncio.create_task(ticket.wait())
    await asyncio.sleep(0)
    running.release()
    assert ticket.granted
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert after.granted and admission.load("i").active == 1


async def test_no_queue_at_all():
    admission = Admission(parallel=1, max_queue=0)
    admission.enter("i", "a")
    with pytest.raises(Overloaded):
        admission.enter("i", "b")


# ------------------------------------------------------------------------------------------------- context


def _words(request: Request) -> int:
    """A stand-in tokenizer: one token per word."""
    return sum(len(m.text.split()) for m in request.messages)


def _counter():
    calls = []

    async def count(request: Request) -> int:
        calls.append(request)
        return _words(request)

    return count, calls


def _chat(*texts: str, role: str = "user", **extra) -> Request:
    return Request(model="m", messages=tuple(Message(role=role, parts=(TextPart(text=t),)) for t in texts), **extra)


def _big(words: int) -> str:
    return " ".join(["w"] * words)


async def test_short_prompt_is_not_counted():
    count, calls = _counter()
    request = _chat("hi", max_tokens=100)
    assert await fit_context(request, 4096, count, Fit.PROMPT_AND_OUTPUT) is request
    assert calls == []


async def test_openai_counts_prompt_and_output():
    count, _ = _counter()
    request = _chat(_big(3000), max_tokens=1500)
    with pytest.raises(ContextLengthExceeded) as refused:
        await fit_context(request, 4096, count, Fit.PROMPT_AND_OUTPUT)
    err = refused.value
    assert (err.prompt_tokens, err.completion_tokens, err.context, err.status) == (3000, 1500, 4096, 400)
    fits = _chat(_big(3000), max_tokens=1096)
    assert await fit_context(fits, 4096, count, Fit.PROMPT_AND_OUTPUT) is fits


async def test_openai_without_max_tokens_needs_one_token_of_room():
    count, _ = _counter()
    with pytest.raises(ContextLengthExceeded) as refused:
        await fit_context(_chat(_big(4096)), 4096, count, Fit.PROMPT_AND_OUTPUT)
    assert refused.value.completion_tokens is None
    request = _chat(_big(4095))
    assert await fit_context(request, 4096, count, Fit.PROMPT_AND_OUTPUT) is request


async def test_prompt_rule_ignores_max_tokens():
    """Anthropic: max_tokens 32000 against a 4096 context is fine while the prompt fits."""
    count, _ = _counter()
    request = _chat(_big(3000), max_tokens=32000)
    assert await fit_context(request, 4096, count, Fit.PROMPT) is request
    with pytest.raises(ContextLengthExceeded) as refused:
        await fit_context(_chat(_big(5000), max_tokens=32000), 4096, count, Fit.PROMPT)
    assert (refused.value.prompt_tokens, refused.value.completion_tokens) == (5000, None)


async def test_needed_context_is_zero_when_it_fits_or_nothing_would_hold_it():
    count, calls = _counter()
    assert await needed_context(_chat("hi"), 4096, 32768, count, Fit.DROP_OLDEST) == 0
    assert calls == []  # its bytes show it fits
    assert await needed_context(_chat(_big(4000)), 4096, 32768, count, Fit.PROMPT) == 0
    assert await needed_context(_chat(_big(40000)), 4096, 32768, count, Fit.PROMPT) == 0  # beyond the model's own
    assert await needed_context(_chat(_big(5000)), 4096, 4096, count, Fit.PROMPT) == 0  # no bigger context to have


async def test_needed_context_is_the_whole_prompt_and_room_to_answer():
    count, _ = _counter()
    long = _chat("old " + _big(3000), _big(2000))  # Ollama would drop the first message; growing keeps it
    assert await needed_context(long, 4096, 32768, count, Fit.DROP_OLDEST) == 5001 + 1024
    asked = _chat(_big(3000), max_tokens=3000)  # OpenAI: the output asked for counts
    assert await needed_context(asked, 4096, 32768, count, Fit.PROMPT_AND_OUTPUT) == 6000
    anthropic = _chat(_big(5000), max_tokens=32000)  # Anthropic: only the prompt must fit
    assert await needed_context(anthropic, 4096, 32768, count, Fit.PROMPT) == 5000 + 1024


def test_grown_context_doubles_up_to_the_model_limit():
    assert grown_context(4096, 6024, 32768) == 8192
    assert grown_context(4096, 8193, 32768) == 16384
    assert grown_context(4096, 30000, 20000) == 20000


async def test_drop_oldest_keeps_system_and_the_latest_turn():
    count, calls = _counter()
    messages = (
        Message(role="system", parts=(TextPart(text="be brief"),)),
        *(Message(role="user" if n % 2 == 0 else "assistant", parts=(TextPart(text=_big(300)),)) for n in range(10)),
        Message(role="user", parts=(TextPart(text="and now?"),)),
    )
    request = Request(model="m", messages=messages)
    fitted = await fit_context(request, 1000, count, Fit.DROP_OLDEST)
    assert fitted.messages[0].role == "system" and fitted.messages[-1].text == "and now?"
    assert fitted.messages[1:] == messages[-4:], "the newest turns that fit: three of 300 words and the question"
    assert _words(fitted) < 1000 and len(calls) <= 6, "bisection, not one count per dropped message"


async def test_drop_oldest_keeps_a_tool_result_with_its_call():
    count, _ = _counter()
    call = Message(role="assistant", parts=(ToolCallPart(id="c1", name="f", arguments="{}"), TextPart(text="x")))
    result = Message(
        role="tool", parts=(ToolResultPart(call_id="c1", content=(TextPart(text="out"),)), TextPart(text="out"))
    )
    request = Request(
        model="m",
        messages=(
            Message(role="user", parts=(TextPart(text=_big(900)),)),
            call,
            result,
            Message(role="tool", parts=(TextPart(text="more"),)),
        ),
    )
    fitted = await fit_context(request, 100, count, Fit.DROP_OLDEST)
    assert fitted.messages == (call, result, request.messages[-1])


async def test_drop_oldest_refuses_when_the_last_turn_alone_is_too_long():
    count, _ = _counter()
    with pytest.raises(ContextLengthExceeded):
        await fit_context(_chat("hello", _big(2000)), 1000, count, Fit.DROP_OLDEST)


async def test_a_backend_that_cannot_count_leaves_it_to_the_runner():
    async def count(request: Request) -> int:
        raise UnsupportedFeature("no tokenizer")

    request = _chat(_big(5000))
    assert await fit_context(request, 100, count, Fit.PROMPT) is request
    assert await fit_context(request, 0, count, Fit.PROMPT) is request


def test_token_bound():
    assert token_bound(_chat("héllo")) == 1024 + 64 + 6
    assert token_bound(_chat("x", tools=())) is not None
    with_image = Request(model="m", messages=(Message(role="user", parts=(ImagePart(url="http://x/y.png"),)),))
    assert token_bound(with_image) is None
    assert token_bound(Request(model="m", raw_prompt="abc")) == 1024 + 3


def test_error_rebuilt_from_info_keeps_its_message():
    from meshgate.protocols.model import error_from_info

    err = ContextLengthExceeded(prompt_tokens=10, completion_tokens=5, context=12)
    rebuilt = error_from_info(err.info())
    assert isinstance(rebuilt, ContextLengthExceeded) and rebuilt.message == err.message
    assert (rebuilt.prompt_tokens, rebuilt.completion_tokens, rebuilt.context) == (10, 5, 12), "its numbers travel"
    assert isinstance(error_from_info(Overloaded("busy", retry_after=3).info()), Overloaded)
