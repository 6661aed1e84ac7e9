"""The Ollama model-management wire protocol (``/api/show``, ``/api/ps``, ``/api/copy``, ``/api/delete``,
``/api/create``, ``/api/pull``, ``/api/push``) and ``keep_alive`` durations: pure codecs.

Imports only ``protocols.model``, ``protocols.formats`` (timestamps), ``msgspec`` and the standard library; no
I/O. The gateway gathers the facts (cards, GGUF metadata, instances, the registry of user models) and these
functions only shape them.

- ``keep_alive`` (OLL-15) is seconds (a number) or a Go duration (``"5m"``, ``"1h30m"``, ``"0"``, ``"-1s"``);
  a bare number in a string is read as seconds too. ``parse_keep_alive`` returns ``None`` when none was given,
  ``0.0`` for "unload after the request", ``math.inf`` for any negative value ("keep forever").
- ``/api/ps`` reports when each model is unloaded, longest-lived first, as Ollama does. A model kept forever
  (meshgate's default, or a negative ``keep_alive``) expires ``FOREVER`` seconds after it was last made ready
  or given its expiry: Ollama turns a negative duration into ``math.MaxInt64`` nanoseconds and adds it to the
  moment the model went idle (``api/types.go Duration.UnmarshalJSON``, ``server/sched.go``), so a model kept
  since 2026 "expires" in 2318 or 2319.
- Progress streams (OLL-45) are NDJSON ``{status, digest?, total?, completed?}`` objects ending in
  ``{"status":"success"}``; without streaming only the last object is sent.
- Model names that ``/api/create``, ``/api/copy`` (destination) and ``/api/delete`` accept follow Ollama's
  ``types/model/name.go``: ``[host/][namespace/]model[:tag]``; each part starts with a letter, digit or ``_`` and
  continues with letters, digits, ``_``, ``-`` and ``.`` (no ``.`` in a namespace; a host may also have ``:`` for
  a port, and an ``http://``/``https://`` scheme, which is dropped); model, namespace and tag are 1..80 characters,
  a host 1..350. Ollama's newer ``host/namespace/kind/model`` form (``kind`` is ``skill``, ``agent`` or ``mcp``)
  names no model, so it is not accepted.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from meshgate.protocols.formats import rfc3339
from meshgate.protocols.model import InvalidRequest, ModelInfo

__all__ = [
    "CopyRequest",
    "CreateRequest",
    "DeleteRequest",
    "PullRequest",
    "ShowRequest",
    "encode_ps",
    "encode_show",
    "error_line",
    "format_parameters",
    "parse_keep_alive",
    "parse_model_name",
    "progress_line",
]

FOREVER = (2**63 - 1) / 1e9
"""Ollama's "forever" in seconds: ``math.MaxInt64`` nanoseconds, about 292 years (see the module docstring)."""


class ShowRequest(msgspec.Struct, kw_only=True):
    """``POST /api/show`` (OLL-42); older clients send ``name``."""

    model: str | None = None
    name: str | None = None
    verbose: bool = False

    @property
    def target(self) -> str:
        return _required(self.model or self.name, "model")


class CopyRequest(msgspec.Struct, kw_only=True):
    """``POST /api/copy`` (OLL-46)."""

    source: str
    destination: str


class DeleteRequest(msgspec.Struct, kw_only=True):
    """``DELETE /api/delete`` (OLL-46); older clients send ``name``."""

    model: str | None = None
    name: str | None = None

    @property
    def target(self) -> str:
        return _required(self.model or self.name, "model")


class CreateRequest(msgspec.Struct, kw_only=True, rename={"from_": "from"}):
    """``POST /api/create`` (OLL-45): ``from`` a GGUF path or a model name, plus what to store with it."""

    model: str | None = None
    name: str | None = None
    from_: str | None = None
    files: dict[str, str] | None = None
    adapters: dict[str, str] | None = None
    template: str | None = None
    system: str | None = None
    parameters: dict[str, Any] | None = None
    quantize: str | None = None
    license: str | list[str] | None = None
    messages: list[dict[str, Any]] | None = None
    stream: bool | None = None

    @property
    def target(self) -> str:
        return _required(self.model or self.name, "model")


class PullRequest(msgspec.Struct, kw_only=True):
    """``POST /api/pull`` and ``POST /api/push`` (OLL-45)."""

    model: str | None = None
    name: str | None = None
    insecure: bool = False
    stream: bool | None = None

    @property
    def target(self) -> str:
        return _required(self.model or self.name, "model")


def _required(value: str | None, param: str) -> str:
    if not value:
        raise InvalidRequest(f"{param} is required", param=param)
    return value


# ---------------------------------------------------------------------------------------------------- model names

MAX_PART_LEN = 80
MAX_HOST_LEN = 350
NAME_RULE = (
    "a model name is [host/][namespace/]model[:tag]: each part starts with a letter, digit or '_' and "
    "continues with letters, digits, '_', '-' or '.' (no '.' in the namespace; the host may add ':port'), "
    f"at most {MAX_PART_LEN} characters a part ({MAX_HOST_LEN} for the host)"
)
_MODEL_OR_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_NAMESPACE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*")
_HOST = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]*")


def parse_model_name(name: str, param: str = "model") -> str:
    """``name`` if Ollama would accept it as a model name (the module docstring has the rules), without a URL scheme.

    Parsed as Ollama parses it: the tag after a ``:`` that follows the last ``/``, the model after the last ``/``,
    the namespace before it, and everything before that the host.

    Raises:
        InvalidRequest: ``<param> "<name>" is invalid: <the rules>`` (Ollama's ``destination "x" is invalid``,
            with what is allowed).
    """
    rest, tag = name, None
    if name.rfind(":") > name.rfind("/"):
        rest, _, tag = name.rpartition(":")
    head, slash, model = rest.rpartition("/")
    namespace = host = None
    if slash:
        head, slash, namespace = head.rpartition("/")
        if slash:
            scheme, sep, host = head.partition("://")
            host = host if sep else scheme
    parts = [
        (model, _MODEL_OR_TAG, MAX_PART_LEN),
        (tag, _MODEL_OR_TAG, MAX_PART_LEN),
        (namespace, _NAMESPACE, MAX_PART_LEN),
        (host, _HOST, MAX_HOST_LEN),
    ]
    if not all(part is None or (len(part) <= limit and pattern.fullmatch(part)) for part, pattern, limit in parts):
        shown = name if len(name) <= 100 else name[:100] + "..."
        raise InvalidRequest(f"{param} {msgspec.json.encode(shown).decode()} is invalid: {NAME_RULE}", param=param)
    return "".join(
        [
            f"{host}/" if host is not None else "",
            f"{namespace}/" if namespace is not None else "",
            model,
            f":{tag}" if tag is not None else "",
        ]
    )


# ---------------------------------------------------------------------------------------------------- keep_alive

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|μs|ms|s|m|h)")


def parse_keep_alive(value: float | str | None) -> float | None:
    """Seconds to keep a model loaded after a request: ``None`` (not given), ``0.0`` (unload), ``math.inf``
    (forever, any negative value), else the positive duration.

    Raises:
        InvalidRequest: a string that is neither a Go duration nor a number.
    """
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = float(body)
        except ValueError:
            if not body or _DURATION.sub("", body):
                raise InvalidRequest(
                    f'keep_alive must be seconds or a duration like "5m" or "1h"; got {value!r}', param="keep_alive"
                ) from None
            seconds = sum(float(n) * _UNITS[unit] for n, unit in _DURATION.findall(body))
        seconds *= sign
    else:
        seconds = float(value)
    if seconds < 0:
        return math.inf
    return seconds


# ---------------------------------------------------------------------------------------------------- show, ps


def _details(info: ModelInfo) -> dict[str, Any]:
    return {
        "parent_model": "",
        "format": info.format,
        "family": info.family,
        "families": [info.family] if info.family else [],
        "parameter_size": info.parameter_size,
        "quantization_level": info.quantization,
    }


def format_parameters(parameters: Mapping[str, Any]) -> str:
    """Ollama's one-string ``parameters``: a ``name value`` line per value (lists give a line per item)."""
    lines = []
    for name, value in parameters.items():
        for item in value if isinstance(value, list) else [value]:
            rendered = (
                msgspec.json.encode(item).decode()
                if isinstance(item, str)
                else str(item).lower()
                if isinstance(item, bool)
                else str(item)
            )
            lines.append(f"{name:<30} {rendered}")
    return "\n".join(lines)


def _modelfile(info: ModelInfo, path: str, template: str, system: str, parameters: Mapping[str, Any]) -> str:
    lines = [
        '# Modelfile generated by "ollama show"',
        "# To build a new Modelfile based on this, replace FROM with:",
        f"# FROM {info.name}",
        "",
        f"FROM {path}",
    ]
    if template:
        lines.append(f'TEMPLATE """{template}"""')
    if system:
        lines.append(f'SYSTEM """{system}"""')
    for name, value in parameters.items():
        for item in value if isinstance(value, list) else [value]:
            lines.append(f"PARAMETER {name} {msgspec.json.encode(item).decode() if isinstance(item, str) else item}")
    return "\n".join(lines) + "\n"


def encode_show(
    info: ModelInfo,
    *,
    path: str,
    model_info: Mapping[str, Any],
    capabilities: Sequence[str],
    template: str = "",
    system: str = "",
    parameters: Mapping[str, Any] | None = None,
    license: str = "",
) -> bytes:
    """``POST /api/show`` (OLL-42). ``model_info`` is always present (ollama-python requires the key)."""
    parameters = parameters or {}
    body: dict[str, Any] = {
        "modelfile": _modelfile(info, path, template, system, parameters),
        "parameters": format_parameters(parameters),
        "template": template,
    }
    if system:
        body["system"] = system
    if license:
        body["license"] = license
    body.update(
        {
            "details": _details(info),
            "model_info": dict(model_info),
            "capabilities": list(capabilities),
            "modified_at": rfc3339(info.created),
        }
    )
    return msgspec.json.encode(body)


def encode_ps(loaded: Iterable[tuple[ModelInfo, float | None, float]]) -> bytes:
    """``GET /api/ps`` (OLL-41): each loaded model as ``(info, expires_at, since)``, the latest expiry first.

    ``expires_at`` is when the model is unloaded (Unix seconds); ``None`` (or infinity) is never, shown as Ollama
    shows "forever": ``since`` (when it was last made ready or given its expiry) plus ``FOREVER``.
    """
    expiring = [
        (info, since + FOREVER if expires is None or math.isinf(expires) else expires)
        for info, expires, since in loaded
    ]
    expiring.sort(key=lambda pair: -pair[1])  # stable: equal expiries keep their order, as Ollama's sort does
    return msgspec.json.encode(
        {
            "models": [
                {
                    "name": info.name,
                    "model": info.name,
                    "size": info.size,
                    "digest": info.digest,
                    "details": _details(info),
                    "expires_at": rfc3339(expires),
                    "size_vram": 0,
                    "context_length": info.context_length,
                }
                for info, expires in expiring
            ]
        }
    )


# ---------------------------------------------------------------------------------------------------- progress


def progress_line(
    status: str, *, digest: str | None = None, total: int | None = None, completed: int | None = None
) -> bytes:
    """One NDJSON progress object (OLL-45); absent fields are left out."""
    obj: dict[str, Any] = {"status": status}
    if digest is not None:
        obj["digest"] = digest
    if total is not None:
        obj["total"] = total
    if completed is not None:
        obj["completed"] = completed
    return msgspec.json.encode(obj) + b"\n"


def error_line(message: str) -> bytes:
    """Ollama's error body, ``{"error": "<message>"}`` (OLL-34)."""
    return msgspec.json.encode({"error": message})
