"""Turn internal messages into the text a llama.cpp model reads.

Gemma has no system role, so system text is prepended to the first user turn (llama-cpp-python's own
``chat_format="gemma"`` drops it silently). Other families use the GGUF's own chat template through
llama-cpp-python's Jinja2 formatter. Tool results are rendered as user-side text for families without a tool
role.

Tools (``tools.tools_block``) are described in system text after the client's own system prompts. Earlier tool
calls render in the assistant turn as the same ``{"name": ..., "arguments": {...}}`` JSON the model is asked to
answer with, and tool results as ``Result of <tool>: <text>`` in the next user turn (the tool's name is looked up
from the call a result answers when the result itself carries only the call id).
"""

from __future__ import annotations

from collections.abc import Sequence

from meshgate.backends.llama_cpp.tools import render_call, tools_block
from meshgate.protocols.model import (
    Message,
    ReasoningPart,
    Request,
    TextPart,
    ToolCallPart,
    ToolResultPart,
)

__all__ = ["flatten", "render_gemma", "render_prompt"]


def _part_text(part: object, call_names: dict[str, str]) -> str:
    match part:
        case TextPart(text=text):
            return text
        case ToolCallPart(name=name, arguments=args):
            return render_call(name, args)
        case ToolResultPart(call_id=call_id, name=name, content=content):
            body = "".join(p.text for p in content if isinstance(p, TextPart))
            return f"Result of {name or call_names.get(call_id or '') or 'the tool'}: {body}"
        case ReasoningPart():
            return ""  # earlier reasoning is not fed back
    return ""


def flatten(messages: Sequence[Message], tools: str = "") -> list[tuple[str, str]]:
    """Messages as (role, text) turns with system text (then ``tools``, a tools block) folded into the first
    user turn.

    Tool results become user turns; consecutive turns of one role are joined. Linear in the messages: a turn's
    texts are gathered and joined once (joining as they come copied the growing turn each time, minutes of work
    for a long run of one role).
    """
    system = "\n\n".join([*(m.text for m in messages if m.role == "system"), *([tools] if tools else [])])
    call_names = {p.id: p.name for m in messages for p in m.parts if isinstance(p, ToolCallPart)}
    runs: list[tuple[str, list[str]]] = []
    for message in messages:
        if message.role == "system":
            continue
        role = "assistant" if message.role == "assistant" else "user"
        text = "\n".join(t for p in message.parts if (t := _part_text(p, call_names)))
        if runs and runs[-1][0] == role:
            runs[-1][1].append(text)
        else:
            runs.append((role, [text]))
    turns = [(role, "\n\n".join(texts)) for role, texts in runs]
    if system:
        if turns and turns[0][0] == "user":
            turns[0] = ("user", f"{system}\n\n{turns[0][1]}")
        else:
            turns.insert(0, ("user", system))
    return turns


def render_gemma(request: Request) -> str:
    """Gemma's turn format; the BOS token is added by the tokenizer, not here."""
    out = []
    turns = flatten(request.messages, tools_block(request))
    for i, (role, text) in enumerate(turns):
        speaker = "model" if role == "assistant" else "user"
        last_prefill = request.prefill and i == len(turns) - 1 and role == "assistant"
        out.append(f"<start_of_turn>{speaker}\n{text}")
        if last_prefill:
            return "".join(out)
        out.append("<end_of_turn>\n")
    out.append("<start_of_turn>model\n")
    return "".join(out)


def render_prompt(request: Request, family: str, chat_template: str | None, bos: str, eos: str) -> str:
    """The prompt text for ``request``; plain completions pass ``raw_prompt`` through unchanged."""
    if request.raw_prompt is not None:
        return request.raw_prompt
    if family.startswith("gemma") or not chat_template:
        return render_gemma(request)
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    formatter = Jinja2ChatFormatter(template=chat_template, bos_token=bos, eos_token=eos)
    messages = [{"role": role, "content": text} for role, text in flatten(request.messages, tools_block(request))]
    return formatter(messages=messages).prompt  # type: ignore[arg-type]  # plain role/content dicts: what its TypedDicts describe
