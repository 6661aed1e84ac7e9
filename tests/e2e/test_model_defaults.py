"""A model created with stored parameters and a system prompt (Ollama's Modelfile ``PARAMETER`` and ``SYSTEM``,
through ``/api/create``) gets them on every request, whichever official SDK sends it
(``gateway.serving.model_defaults``).

The packaged Gemma 3 270M is a base model that never ends a turn by itself; a stored ``stop`` of ``"\\n"`` ends it
after one line (the greedy answer, by a stored ``temperature`` of 0, ends its line within the stored
``num_predict``), and that is a plain end of turn in every protocol: OpenAI ``finish_reason`` ``stop``, Anthropic
``stop_reason`` ``end_turn``, Ollama ``done_reason`` ``stop``. What a request sets itself wins.
"""

from __future__ import annotations

import pytest

from tests.conftest import MODEL

BRIEF = "gemma3-brief"
SYSTEM = "Answer in one short line."
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def brief(oll) -> str:
    # a stored temperature of 0: every answer is the greedy one, so whether it reaches the stop is not chance
    parameters = {"stop": ["\n"], "num_predict": 24, "temperature": 0}
    done = oll.create(model=BRIEF, from_=MODEL, parameters=parameters, system=SYSTEM)
    assert done.status == "success"
    shown = oll.show(BRIEF)
    assert f'SYSTEM """{SYSTEM}"""' in shown.modelfile and "num_predict" in shown.parameters
    return BRIEF


def test_openai_chat_ends_the_turn_at_the_stored_stop(oai, brief):
    answer = oai.chat.completions.create(model=brief, messages=QUESTION)
    choice = answer.choices[0]
    assert choice.finish_reason == "stop", answer
    assert "\n" not in choice.message.content and answer.usage.completion_tokens <= 24


def test_anthropic_messages_end_turn_not_stop_sequence(ant, brief):
    answer = ant.messages.create(model=brief, max_tokens=64, messages=QUESTION)
    assert answer.stop_reason == "end_turn" and answer.stop_sequence is None, answer
    assert all("\n" not in block.text for block in answer.content)


def test_anthropic_stream_ends_the_turn_too(ant, brief):
    with ant.messages.stream(model=brief, max_tokens=64, messages=QUESTION) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason == "end_turn" and final.stop_sequence is None and "\n" not in text


def test_ollama_chat_done_reason_stop(oll, brief):
    answer = oll.chat(brief, messages=QUESTION)
    assert answer.done_reason == "stop" and "\n" not in answer.message.content, answer
    assert answer.eval_count <= 24


def test_the_stored_system_prompt_is_in_the_prompt(oai, brief):
    """The same question costs the stored system prompt's tokens more on the created model than on its parent."""
    plain = oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    created = oai.chat.completions.create(model=brief, messages=QUESTION, max_tokens=1)
    assert created.usage.prompt_tokens >= plain.usage.prompt_tokens + 5, (plain.usage, created.usage)
    own = [{"role": "system", "content": "Be terse."}, *QUESTION]  # the request's own system message wins
    mine = oai.chat.completions.create(model=brief, messages=own, max_tokens=1)
    assert mine.usage.prompt_tokens < created.usage.prompt_tokens


def test_the_requests_own_stop_wins_and_num_predict_limits_the_output(oai, ant, brief):
    """With a stop of its own, the stored ``"\\n"`` is not added: the answer runs to the stored ``num_predict``;
    and a client's own stop sequence that matches is still Anthropic's ``stop_sequence``."""
    answer = oai.chat.completions.create(model=brief, messages=QUESTION, stop=["zzzz"], temperature=0)
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 24, answer
    own = ant.messages.create(model=brief, max_tokens=64, messages=QUESTION, stop_sequences=["\n", " "])
    assert own.stop_reason == "stop_sequence" and own.stop_sequence in ("\n", " "), own


def test_anthropic_count_tokens_counts_the_stored_system_prompt(ant, brief):
    """count_tokens for a created model counts its stored system prompt as the generation sends it: the count is
    the ``input_tokens`` the same request then reports, and more than the parent model's count."""
    counted = ant.messages.count_tokens(model=brief, messages=QUESTION).input_tokens
    answer = ant.messages.create(model=brief, max_tokens=1, messages=QUESTION)
    assert counted == answer.usage.input_tokens, (counted, answer.usage)
    plain = ant.messages.count_tokens(model=MODEL, messages=QUESTION).input_tokens
    assert counted >= plain + 5, (plain, counted)
