"""Prompt building is linear in the messages (issue step 15, part 4, item 7): a long run of one role's messages,
joined into one turn, once copied the growing turn for each message (seconds for 10,000 messages of 200
characters; a chat of 100,000 took 37-60 s before an answer)."""

from __future__ import annotations

import time

from meshgate.backends.llama_cpp.prompt import flatten, render_gemma
from meshgate.protocols.model import MAX_MESSAGES, Message, Request, TextPart


def _run_of_user_messages(count: int, size: int) -> tuple[Message, ...]:
    return tuple(Message(role="user", parts=(TextPart(text=f"{i:0{size}d}"),)) for i in range(count))


def test_a_run_of_one_role_joins_into_one_turn_in_order():
    turns = flatten((Message(role="system", parts=(TextPart(text="Be brief."),)), *_run_of_user_messages(3, 2)))
    assert turns == [("user", "Be brief.\n\n00\n\n01\n\n02")]


def test_the_most_messages_a_request_may_hold_render_in_well_under_a_second():
    messages = _run_of_user_messages(MAX_MESSAGES, 200)  # 2 MB in one user turn
    started = time.perf_counter()
    prompt = render_gemma(Request(model="m", messages=messages))
    took = time.perf_counter() - started
    assert len(prompt) == MAX_MESSAGES * 202 - 2 + len("<start_of_turn>user\n<end_of_turn>\n<start_of_turn>model\n")
    assert took < 1.0, f"{took:.2f} s: prompt building is not linear"
