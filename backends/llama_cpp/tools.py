"""Tool calls for llama.cpp models that have no tool-call format of their own (Gemma 3 270M is a base model).

The model is told about the tools in a system-text block (``tools_block``) and calls one by answering with
exactly ``{"name": <tool name>, "arguments": {...}}``. How an answer becomes a call depends on ``tool_choice``:

- ``required`` or a named tool: generation is held to ``call_schema`` by a llama.cpp grammar (an ``anyOf`` with
  one ``{"name": const, "arguments": <that tool's parameters>}`` branch per allowed tool), so the answer is a call.
- ``auto``: generation is free; an answer that is, after stripping whitespace, exactly such a JSON call to an
  offered tool becomes a call, anything else is text. Generation stops as soon as the answer so far is a whole
  call (``CallGate.done``): small models often run on past the JSON instead of ending their turn.
- ``none`` (or no tools): nothing here applies and the tools are not shown to the model.

``CallGate`` sits between the token loop and the event stream. Output that may still turn out to be a call is
held back: all of it when a call is forced, and in ``auto`` mode only while the answer so far is blank or starts
with ``{`` (text that starts otherwise streams as usual). The call goes out once, whole, at the end: one
``ToolCallDelta`` (index 0, id ``call_`` + 24 hex digits, the name, the arguments as compact JSON text) and then
``Finished(reason="tool_calls")``. One call per answer: ``parallel_tool_calls`` is not acted on. Held output that
is not a call (a forced call cut short by ``max_tokens`` or a stop string, or ``auto`` JSON that is not a call)
goes out as text with its logprobs and the finish reason generation ended with; a call carries no logprobs.

Imports protocols only (no llama_cpp: the engine builds the grammar from ``call_schema``).
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Literal

from meshgate.protocols.model import Event, Finished, Request, TextDelta, TokenLogprob, Tool, ToolCallDelta

__all__ = [
    "CallGate",
    "allowed_tools",
    "call_mode",
    "call_schema",
    "new_call_id",
    "parse_call",
    "render_call",
    "tools_block",
]

CALL_FORMAT = '{"name": "<tool name>", "arguments": {<the arguments, as the tool\'s parameters describe>}}'

Mode = Literal["off", "auto", "forced"]


def call_mode(request: Request) -> Mode:
    """``forced`` for ``required`` or a named tool, ``auto`` for ``auto``, ``off`` without tools or for ``none``."""
    if not request.tools or request.tool_choice.mode == "none":
        return "off"
    return "auto" if request.tool_choice.mode == "auto" else "forced"


def allowed_tools(request: Request) -> tuple[Tool, ...]:
    """The tools a call may name: only the named one for a named choice."""
    if request.tool_choice.mode == "tool":
        return tuple(t for t in request.tools if t.name == request.tool_choice.name)
    return request.tools


def tools_block(request: Request) -> str:
    """The system text that describes the tools and the call format; empty when tools are off."""
    if call_mode(request) == "off":
        return ""
    lines = ["You can call these tools:", ""]
    for tool in request.tools:
        lines.append(f"- {tool.name}: {tool.description or '(no description)'}")
        lines.append(f"  Parameters (JSON Schema): {json.dumps(tool.parameters)}")
    lines += ["", "To call a tool, answer with only this JSON and nothing else:", CALL_FORMAT]
    match request.tool_choice.mode:
        case "required":
            lines.append("You must call one of the tools now.")
        case "tool":
            lines.append(f"You must call the tool {request.tool_choice.name} now.")
        case _:
            lines.append("If no tool is needed, answer in plain text.")
    return "\n".join(lines)


def call_schema(request: Request) -> dict[str, Any]:
    """The JSON schema a forced answer must match: one branch per allowed tool.

    ``$defs``/``definitions`` of the tools' parameter schemas are lifted to the root, where their local
    ``#/$defs/...`` references resolve.
    """
    branches: list[dict[str, Any]] = []
    defs: dict[str, dict[str, Any]] = {"$defs": {}, "definitions": {}}
    for tool in allowed_tools(request):
        parameters = dict(tool.parameters)
        for key in defs:
            defs[key].update(parameters.pop(key, None) or {})
        branches.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, "arguments": parameters},
                "required": ["name", "arguments"],
            }
        )
    schema: dict[str, Any] = branches[0] if len(branches) == 1 else {"anyOf": branches}
    return {**schema, **{key: value for key, value in defs.items() if value}}


def parse_call(text: str, tools: tuple[Tool, ...]) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` when ``text`` is exactly a call of one of ``tools``, else ``None``."""
    try:
        value = json.loads(text)
        if not isinstance(value, dict) or set(value) != {"name", "arguments"}:
            return None
        name, arguments = value["name"], value["arguments"]
        if not isinstance(name, str) or name not in {t.name for t in tools} or not isinstance(arguments, dict):
            return None
        return name, json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
    except (ValueError, RecursionError):  # not JSON, or nested too deeply to be a call
        return None


def render_call(name: str, arguments: str) -> str:
    """An earlier call as the model would have answered it (arguments that are not JSON go in as they are)."""
    try:
        return json.dumps({"name": name, "arguments": json.loads(arguments or "{}")}, ensure_ascii=False)
    except (ValueError, RecursionError):  # not JSON, or nested too deeply to write back
        return f'{{"name": {json.dumps(name)}, "arguments": {arguments}}}'


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class CallGate:
    """Streams text through, or holds it while it may still be a tool call (see the module docstring)."""

    def __init__(self, request: Request) -> None:
        self.mode = call_mode(request)
        self.tools = allowed_tools(request)
        self.logprobs = request.logprobs
        self.held: list[str] = []
        self.held_logprobs: list[TokenLogprob] = []
        self.holding = self.mode != "off"

    def feed(self, text: str, logprobs: tuple[TokenLogprob, ...] = ()) -> list[Event]:
        """Output text (and the logprobs of the tokens it starts); returns what may go out now."""
        if not self.holding:
            return [self._delta(text, logprobs)] if text or logprobs else []
        self.held.append(text)
        self.held_logprobs.extend(logprobs)
        start = "".join(self.held).lstrip()
        if self.mode == "auto" and start and not start.startswith("{"):
            self.holding = False
            return self._release()
        return []

    @property
    def done(self) -> bool:
        """Whether the held answer is already a whole call, so that generating more can only spoil it."""
        if not self.holding or not self.held or not self.held[-1].rstrip().endswith("}"):
            return False
        return parse_call("".join(self.held).strip(), self.tools) is not None

    def close(self, finish: Finished) -> tuple[list[Event], Finished]:
        """At the end of generation: the held call or text, and the finish event to send."""
        if self.holding and (call := parse_call("".join(self.held).strip(), self.tools)) is not None:
            name, arguments = call
            delta = ToolCallDelta(index=0, id=new_call_id(), name=name, arguments=arguments)
            return [delta], Finished(reason="tool_calls")
        events = self._release()
        if self.logprobs and not events:  # so that asked-for logprobs read [] rather than null
            events = [TextDelta(text="", logprobs=())]
        return events, finish

    def _release(self) -> list[Event]:
        text, logprobs = "".join(self.held), tuple(self.held_logprobs)
        self.held, self.held_logprobs = [], []
        return [self._delta(text, logprobs)] if text or logprobs else []

    def _delta(self, text: str, logprobs: tuple[TokenLogprob, ...]) -> TextDelta:
        return TextDelta(text=text, logprobs=logprobs if self.logprobs else None)
