"""A user model's stored defaults (Ollama Modelfile ``PARAMETER`` and ``SYSTEM``) applied to each request for it.

``/api/create`` stores a system prompt and parameters with a model (``backends.registry.UserModel``); Ollama applies
them to every request for that model, whatever API it came through, and so does meshgate, in one place: the
dispatcher calls ``apply_defaults`` once the model is resolved, for a generation and for Anthropic's count_tokens
(so a count includes the stored system prompt the generation will send). The request always wins: a stored value
fills only what the client left unset.

- ``stop`` is added when the request sets none. A turn ended by such a stop is a plain end of turn
  (``end_turn_at_default_stops``): Anthropic ``end_turn``, OpenAI and Ollama ``stop``; ``stop_sequence`` (with
  the string matched) stays for the client's own ``stop_sequences``.
- ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``, ``repeat_penalty``, ``presence_penalty`` and
  ``frequency_penalty`` fill the sampling values the request leaves ``UNSET`` (an explicit ``null`` is the
  client's choice and stays).
- ``num_predict`` above 0 is ``max_tokens`` when the request sets none (0 or less: no limit, as in Ollama);
  ``num_ctx`` above 0 is the context when the request sets none.
- ``system`` becomes a system message when the request has none (a raw prompt has no messages and gets none).

Stored values are taken as the Ollama server takes a Modelfile's: numbers may be strings (``"0.2"``), ``stop`` a
string or a list. A value that is not of its type, or outside the range a request may ask for, is skipped (logged
at debug), so a bad entry never breaks the model's requests. Other parameters (``num_gpu``,
``mirostat``, ...) are shown by ``/api/show`` and not applied, as meshgate has no such setting.

``apply_defaults`` and ``end_turn_at_default_stops`` are pure; ``UserModels`` reads the registry file again only
when it changed (one ``stat`` per request). Imports ``protocols.model``, ``backends.registry`` and
``gateway.serving.streams``.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import msgspec

from meshgate.backends.registry import ModelRegistry, UserModel
from meshgate.gateway.serving.streams import closing
from meshgate.protocols.model import UNSET, Event, Finished, Message, Request, TextPart

__all__ = ["UserModels", "apply_defaults", "end_turn_at_default_stops"]

log = logging.getLogger("meshgate.model_defaults")

_FLOATS: dict[str, Callable[[float], bool]] = {  # sampling values and the range a request may ask for
    "temperature": lambda v: v >= 0,
    "top_p": lambda v: 0 <= v <= 1,
    "min_p": lambda v: 0 <= v <= 1,
    "repeat_penalty": lambda v: v > 0,
    "presence_penalty": lambda v: True,
    "frequency_penalty": lambda v: True,
}
_INTS: dict[str, Callable[[int], bool]] = {"top_k": lambda v: v >= 0, "seed": lambda v: True}


def apply_defaults(request: Request, model: UserModel | None) -> Request:
    """``request`` with ``model``'s stored parameters and system prompt filling what the request left unset (see
    the module docstring); ``request`` itself when there is no user model or nothing to fill."""
    if model is None or not (model.parameters or model.system):
        return request
    params = model.parameters
    changes: dict[str, Any] = {}
    sampling: dict[str, Any] = {}
    for name, ok in _FLOATS.items():
        if getattr(request.sampling, name) is UNSET and (value := _number(params, name, float, ok)) is not None:
            sampling[name] = value
    for name, ok_int in _INTS.items():
        if getattr(request.sampling, name) is UNSET and (value := _number(params, name, int, ok_int)) is not None:
            sampling[name] = value
    if sampling:
        changes["sampling"] = msgspec.structs.replace(request.sampling, **sampling)
    if not request.stop and (stop := _stops(params)):
        changes["stop"] = stop
    if request.max_tokens is None and (limit := _number(params, "num_predict", int, lambda v: True)) is not None:
        if limit > 0:
            changes["max_tokens"] = limit
    if request.num_ctx is UNSET and (context := _number(params, "num_ctx", int, lambda v: v > 0)) is not None:
        changes["num_ctx"] = context
    if model.system and request.raw_prompt is None and not any(m.role == "system" for m in request.messages):
        changes["messages"] = (Message(role="system", parts=(TextPart(text=model.system),)), *request.messages)
    return msgspec.structs.replace(request, **changes) if changes else request


async def end_turn_at_default_stops(events: AsyncIterator[Event]) -> AsyncIterator[Event]:
    """``events`` of a request whose stops came from its model's defaults (``prepare.Prepared.defaults_end_turn``):
    a turn such a stop ended is a plain end of turn, ``Finished(reason="stop")``."""
    async with closing(events):  # the dispatcher's streams release their queue slot on close
        async for event in events:
            if isinstance(event, Finished) and event.reason == "stop_sequence":
                event = Finished(reason="stop")
            yield event


def _stops(params: Mapping[str, Any]) -> tuple[str, ...]:
    value = params.get("stop")
    values = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    return tuple(s for s in values if isinstance(s, str) and s)


def _number(params: Mapping[str, Any], name: str, kind: type, ok: Callable[[Any], bool]) -> Any:
    """``params[name]`` as ``kind`` (a number or its text) when it is in range, else ``None`` (skipped, logged)."""
    raw = params.get(name)
    if raw is None:
        return None
    value: Any = None
    if isinstance(raw, bool):
        value = None
    elif kind is int and isinstance(raw, int | str):
        try:
            value = int(raw)
        except ValueError:
            value = None
    elif kind is float and isinstance(raw, int | float | str):
        try:
            value = float(raw)
        except ValueError:
            value = None
        if value is not None and not math.isfinite(value):
            value = None
    if value is None or not ok(value):
        log.debug("stored parameter %s=%r is not a valid value; it is not applied", name, raw)
        return None
    return value


class UserModels:
    """The registry's user models by name, read again only when ``registry.json`` changed.

    Example::

        user_models = UserModels(ModelRegistry.in_data_dir(settings.data_dir))
        request = apply_defaults(request, user_models(card.name))
    """

    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry
        self._seen: tuple[int, int, int] | None = None
        self._models: dict[str, UserModel] = {}

    def __call__(self, name: str) -> UserModel | None:
        try:
            stat = os.stat(self.registry.path)
            seen: tuple[int, int, int] | None = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        except FileNotFoundError:
            seen = None
        if seen != self._seen:
            try:
                self._models = self.registry.models() if seen is not None else {}
            except (OSError, msgspec.DecodeError):
                log.exception("the model registry %s cannot be read; no stored defaults apply", self.registry.path)
                self._models = {}
            self._seen = seen
        return self._models.get(name)
