"""Tool calls for llama.cpp models that have no tool-call format of their own (Gemma 3 270M is a base model).

The model is told about the tools in a system-text block (``tools_block``) and calls one by answering with
exactly ``{"name": <tool name>, "arguments": {...}}``. How an answer becomes a call depends on ``tool_choice``:

- Forced with a known tool (``Request.forced_tool``: a named tool, or ``required`` with one tool): the prompt
  already holds the start of the call, ``{"name": "<tool>", "arguments": `` (``call_prefix``), and the model
  writes only the arguments, held to the tool's parameter schema by a grammar (``forced_schema``), so every
  output token goes to the arguments, as with the reference servers.
- ``required`` among several tools: the model writes the whole call, held to ``call_schema`` (an ``anyOf`` with
  one ``{"name": const, "arguments": <that tool's parameters>}`` branch per tool), so it picks the name first
  and then that tool's arguments.
- Forced arguments go out as compact JSON: the gate drops whitespace outside strings as the text comes. The
  grammar itself has the model write ``", "`` and ``": "`` between items (``grammar.OPTIONS``): held to no
  space at all, Gemma 3 270M, which learnt ``"city": "Paris"``, answered ``{"city":""}`` to "What is the
  weather in Paris?" (the rejected `` "`` made ``""`` the likeliest allowed token).
- ``auto``: generation is free; an answer that is, after stripping whitespace, exactly such a JSON call to an
  offered tool becomes a call, anything else is text. Generation stops as soon as the answer so far is a whole
  call (``CallGate.done``): small models often run on past the JSON instead of ending their turn.
- ``none`` (or no tools): nothing here applies and the tools are not shown to the model.

``CallGate`` sits between the token loop and the event stream. A forced answer is always a call, streamed as it
comes: one ``ToolCallDelta`` with index 0, id ``call_`` + 24 hex digits and the name (as soon as the name is
known), then the argument text in fragments. It ends in ``Finished(reason="tool_calls")`` when the arguments are
whole, else with the finish generation ended with (``length`` when ``max_tokens`` cut it short: the arguments are
then a prefix of JSON, as the reference servers return them). Only a ``required`` answer cut short before its
name is decided (two tools whose names share the prefix written so far) goes out as text. Stop strings do not
apply to a forced call (the engine leaves them out): the grammar decides where it ends.

In ``auto`` mode output that may still turn out to be a call is held back while the answer so far is blank or
starts with ``{`` (text that starts otherwise streams as usual), and the call goes out once, whole, at the end.
Held output that is not a call goes out as text with its logprobs and the finish reason generation ended with.
A call carries no logprobs. One call per answer: ``parallel_tool_calls`` is not acted on.

Imports protocols only (no llama_cpp: the engine builds the grammar from ``forced_schema``, ``grammar.py``).
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
    "call_prefix",
    "call_schema",
    "forced_schema",
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
    return "forced" if request.calls_forced else "auto"


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


def call_prefix(request: Request) -> str:
    """The start of the call, put after the prompt, when the tool is forced: the model goes on with the arguments.

    Written as ``render_call`` writes earlier calls in the history; empty unless ``Request.forced_tool`` is set.
    """
    tool = request.forced_tool
    if tool is None or call_mode(request) != "forced":
        return ""
    return f'{{"name": {json.dumps(tool.name, ensure_ascii=False)}, "arguments": '


def _lift_defs(schemas: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The schemas without their ``$defs``/``definitions``, and those gathered for the root, where local
    ``#/$defs/...`` references resolve."""
    defs: dict[str, dict[str, Any]] = {"$defs": {}, "definitions": {}}
    bare = []
    for schema in schemas:
        schema = dict(schema)
        for key in defs:
            defs[key].update(schema.pop(key, None) or {})
        bare.append(schema)
    return bare, {key: value for key, value in defs.items() if value}


def call_schema(request: Request) -> dict[str, Any]:
    """The JSON schema of a whole call: one ``{"name", "arguments"}`` branch per allowed tool."""
    tools = allowed_tools(request)
    parameters, defs = _lift_defs([t.parameters for t in tools])
    branches: list[dict[str, Any]] = [
        {
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": arguments},
            "required": ["name", "arguments"],
        }
        for tool, arguments in zip(tools, parameters, strict=True)
    ]
    schema: dict[str, Any] = branches[0] if len(branches) == 1 else {"anyOf": branches}
    return {**schema, **defs}


def forced_schema(request: Request) -> dict[str, Any]:
    """What a forced answer is held to: the forced tool's parameters, else (the model picks) ``call_schema``."""
    tool = request.forced_tool
    if tool is None:
        return call_schema(request)
    [parameters], defs = _lift_defs([tool.parameters])
    return {**parameters, **defs}


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


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


class CallGate:
    """Streams text through, holds it while it may still be a tool call, or streams a forced call (see the
    module docstring)."""

    def __init__(self, request: Request) -> None:
        self.mode = call_mode(request)
        self.tools = allowed_tools(request)
        self.logprobs = request.logprobs
        self.held: list[str] = []
        self.held_logprobs: list[TokenLogprob] = []
        self.holding = self.mode == "auto"
        # forced: the whole call is the model's own text unless the name is known (then it is the arguments)
        forced = request.forced_tool if self.mode == "forced" else None
        self.name: str | None = forced.name if forced is not None else None
        self.whole_call = self.mode == "forced" and forced is None
        self.heads = {t.name: f'{{"name":{json.dumps(t.name, ensure_ascii=False)},"arguments":' for t in self.tools}
        self.call_id = new_call_id()
        self.head_sent = False
        self.sent = 0  # characters of the arguments already sent
        self.in_string = self.escaped = False  # where the forced call's text is, for ``_compact``

    def feed(self, text: str, logprobs: tuple[TokenLogprob, ...] = ()) -> list[Event]:
        """Output text (and the logprobs of the tokens it starts); returns what may go out now."""
        if self.mode == "forced":
            self.held.append(self._compact(text))
            self.held_logprobs.extend(logprobs)
            return self._stream_call(final=False)
        if not self.holding:
            return [self._delta(text, logprobs)] if text or logprobs else []
        self.held.append(text)
        self.held_logprobs.extend(logprobs)
        start = "".join(self.held).lstrip()
        if start and not start.startswith("{"):
            self.holding = False
            return self._release()
        return []

    @property
    def done(self) -> bool:
        """Whether the held answer is already a whole call, so that generating more can only spoil it."""
        if not self.held or not self.held[-1].rstrip().endswith("}"):
            return False
        if self.mode == "forced":
            arguments = self._arguments()
            return arguments is not None and arguments[1]
        return self.holding and parse_call("".join(self.held).strip(), self.tools) is not None

    def close(self, finish: Finished) -> tuple[list[Event], Finished]:
        """At the end of generation: the held call or text, and the finish event to send."""
        if self.mode == "forced":
            if self.name is None:
                self._decide_name()
            if self.name is not None:
                events = self._stream_call(final=True)
                arguments = self._arguments()
                whole = arguments is not None and arguments[1]
                return events, Finished(reason="tool_calls") if whole or finish.reason == "stop" else finish
        elif self.holding and (call := parse_call("".join(self.held).strip(), self.tools)) is not None:
            name, arguments_text = call
            delta = ToolCallDelta(index=0, id=new_call_id(), name=name, arguments=arguments_text)
            return [delta], Finished(reason="tool_calls")
        events = self._release()
        if self.logprobs and not events:  # so that asked-for logprobs read [] rather than null
            events = [TextDelta(text="", logprobs=())]
        return events, finish

    # ------------------------------------------------------------------------------------------ forced calls

    def _arguments(self) -> tuple[str, bool] | None:
        """The argument text so far and whether it is whole; ``None`` while the name is not yet written."""
        text = "".join(self.held)
        if not self.whole_call:
            return text, _is_object(text)
        if self.name is None:
            self.name = next((name for name, head in self.heads.items() if text.startswith(head)), None)
            if self.name is None:
                return None
        arguments = text[len(self.heads[self.name]) :]
        # the call's own closing brace follows the arguments: it is not theirs
        if arguments.endswith("}") and _is_object(arguments[:-1]) and _is_object(text):
            return arguments[:-1], True
        return arguments, False

    def _stream_call(self, *, final: bool) -> list[Event]:
        """The head once the name is known, then the argument text not yet sent. Until the end, a ``}`` last
        in a whole call's text is held back: it may be the call's own closing brace."""
        arguments = self._arguments()
        if arguments is None:
            return []
        text, whole = arguments
        if self.whole_call and not whole and not final and text.endswith("}"):
            text = text[:-1]
        events: list[Event] = []
        if not self.head_sent:
            events.append(ToolCallDelta(index=0, id=self.call_id, name=self.name, arguments=""))
            self.head_sent = True
        if len(text) > self.sent:
            events.append(ToolCallDelta(index=0, arguments=text[self.sent :]))
            self.sent = len(text)
        return events

    def _compact(self, text: str) -> str:
        """``text`` without the whitespace outside JSON strings (the string state carries over between pieces)."""
        kept = []
        for c in text:
            if self.in_string:
                self.in_string = self.escaped or c != '"'
                self.escaped = not self.escaped and c == "\\"
            elif c == '"':
                self.in_string = True
            elif c in " \t\n\r":
                continue
            kept.append(c)
        return "".join(kept)

    def _decide_name(self) -> None:
        """A call cut short in its name: the name when only one tool's call starts with the text written."""
        text = "".join(self.held)
        names = [name for name, head in self.heads.items() if head.startswith(text) or text.startswith(head)]
        if len(names) == 1:
            self.name = names[0]
            self.held = [self.heads[self.name]]  # the rest of the name is what the grammar would have written

    # ------------------------------------------------------------------------------------------ text

    def _release(self) -> list[Event]:
        text, logprobs = "".join(self.held), tuple(self.held_logprobs)
        self.held, self.held_logprobs = [], []
        return [self._delta(text, logprobs)] if text or logprobs else []

    def _delta(self, text: str, logprobs: tuple[TokenLogprob, ...]) -> TextDelta:
        return TextDelta(text=text, logprobs=logprobs if self.logprobs else None)
