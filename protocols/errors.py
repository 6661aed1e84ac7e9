"""The errors meshgate reports to clients, and their serializable form (``ErrorInfo``, which ``Failed`` carries).

Part of the internal model (``protocols.model`` re-exports every name here); imports nothing of ours.

Error tree (status on the class)::

    GatewayError (500)
    ├── InvalidRequest (400)
    │   ├── UnsupportedFeature (400)
    │   ├── ContextLengthExceeded (400)  the prompt (plus the output asked for) does not fit the context
    │   └── OutputTooLarge (400)         more output asked for than the gateway allows one request
    ├── AuthenticationFailed (401)
    ├── NotFound (404)
    │   └── UnknownModel (404)
    ├── RequestTooLarge (413)
    ├── Unprocessable (422)
    ├── RateLimited (429)
    ├── NoCapacity (503)          no placement fits / overloaded
    │   ├── Overloaded (503)      the instance's queue is full; retry after ``retry_after`` seconds
    │   └── StoreUnavailable (503) the cluster's state store did not answer in time; retry after ``retry_after``
    ├── BackendUnavailable (503)  runner down, crashed or unreachable
    ├── BackendProtocolError (502)
    └── BackendTimeout (504)
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

__all__ = [
    "AuthenticationFailed",
    "BackendProtocolError",
    "BackendTimeout",
    "BackendUnavailable",
    "ContextLengthExceeded",
    "ErrorInfo",
    "GatewayError",
    "InvalidRequest",
    "NoCapacity",
    "NotFound",
    "OutputTooLarge",
    "Overloaded",
    "PermissionDenied",
    "RateLimited",
    "RequestTooLarge",
    "StoreUnavailable",
    "UnknownModel",
    "Unprocessable",
    "UnsupportedFeature",
    "error_from_info",
]


class ErrorInfo(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A serializable error: ``kind`` is a ``GatewayError`` subclass name; ``param`` the field it is about;
    ``detail`` the numbers a protocol words its own message from (``ContextLengthExceeded``'s token counts), so
    an error that reaches a client mid-stream reads as it would have as an HTTP error."""

    kind: str
    message: str
    param: str | None = None
    detail: dict[str, int | None] | None = None


class GatewayError(Exception):
    """Base of every error meshgate reports to a client. ``status`` is the HTTP status it maps to."""

    status: ClassVar[int] = 500

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def info(self) -> ErrorInfo:
        return ErrorInfo(kind=type(self).__name__, message=self.message, param=self.param)


class InvalidRequest(GatewayError):
    status = 400


class UnsupportedFeature(InvalidRequest):
    status = 400


class ContextLengthExceeded(InvalidRequest):
    """The prompt, or the prompt plus the output the client asked for, does not fit the model's context.

    ``completion_tokens`` is the output asked for, or ``None`` when only the prompt was checked (the output is
    then capped by the room left). Rebuilt from an ``ErrorInfo`` (a ``Failed`` event) it keeps only the message
    (``context`` is then 0); protocols render their own wording from the numbers when they have them.
    """

    status = 400

    def __init__(
        self,
        message: str | None = None,
        *,
        prompt_tokens: int = 0,
        completion_tokens: int | None = None,
        context: int = 0,
        param: str | None = "messages",
    ) -> None:
        if message is None:
            asked = "" if completion_tokens is None else f" and {completion_tokens} asked for the output"
            message = (
                f"the prompt has {prompt_tokens} tokens{asked}, but the model's context holds {context}; "
                f"shorten the prompt{'' if completion_tokens is None else ' or ask for less output'}"
            )
        super().__init__(message, param=param)
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.context = context

    def info(self) -> ErrorInfo:
        detail = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}
        return msgspec.structs.replace(super().info(), detail={**detail, "context": self.context})


class OutputTooLarge(InvalidRequest):
    """A request asks for more output tokens (``asked``) than the gateway allows one request (``limit``).

    Protocols that refuse it render their own wording from the numbers; rebuilt from an ``ErrorInfo`` it keeps
    only the message (``limit`` is then 0).
    """

    status = 400

    def __init__(
        self,
        message: str | None = None,
        *,
        asked: int = 0,
        limit: int = 0,
        model: str = "",
        param: str | None = "max_tokens",
    ) -> None:
        if message is None:
            message = (
                f"max_tokens is {asked}, more than the {limit} output tokens one request may ask of "
                f"{model or 'this model'}; ask for fewer"
            )
        super().__init__(message, param=param)
        self.asked = asked
        self.limit = limit
        self.model = model


class AuthenticationFailed(GatewayError):
    status = 401


class PermissionDenied(GatewayError):
    """A valid key without the scope an endpoint needs."""

    status = 403


class NotFound(GatewayError):
    status = 404


class UnknownModel(NotFound):
    def __init__(self, model: str) -> None:
        super().__init__(f"model '{model}' not found", param="model")
        self.model = model


class RequestTooLarge(GatewayError):
    status = 413


class RateLimited(GatewayError):
    status = 429

    def __init__(self, message: str, *, param: str | None = None, retry_after: float = 1.0) -> None:
        super().__init__(message, param=param)
        self.retry_after = retry_after


class Unprocessable(GatewayError):
    """Well-formed, but the content cannot be processed (e.g. a JSON schema the model cannot be held to)."""

    status = 422


class NoCapacity(GatewayError):
    status = 503


class Overloaded(NoCapacity):
    """Too many requests already wait for the model; ``retry_after`` is a fair guess in seconds."""

    def __init__(self, message: str, *, param: str | None = None, retry_after: float = 1.0) -> None:
        super().__init__(message, param=param)
        self.retry_after = retry_after


class StoreUnavailable(NoCapacity):
    """The cluster's state store (Redis) did not answer within its timeout, or refused the connection. The message
    never names the store's address; ``retry_after`` is a fair guess in seconds."""

    def __init__(self, message: str = "", *, param: str | None = None, retry_after: float = 2.0) -> None:
        super().__init__(message or "the cluster's state store is unreachable; retry shortly", param=param)
        self.retry_after = retry_after


class BackendUnavailable(GatewayError):
    status = 503


class BackendProtocolError(GatewayError):
    status = 502


class BackendTimeout(GatewayError):
    status = 504


def _subclasses(cls: type[GatewayError]) -> dict[str, type[GatewayError]]:
    found = {cls.__name__: cls}
    for sub in cls.__subclasses__():
        found.update(_subclasses(sub))
    return found


def error_from_info(info: ErrorInfo) -> GatewayError:
    """Rebuild the exception a ``Failed`` event describes (unknown kinds become ``GatewayError``)."""
    cls = _subclasses(GatewayError).get(info.kind, GatewayError)
    if cls is UnknownModel:
        err: GatewayError = NotFound(info.message, param="model")
    elif cls is ContextLengthExceeded and info.detail:
        err = ContextLengthExceeded(info.message, **info.detail)  # type: ignore[arg-type]  # its own info()'s keys
    else:
        err = cls(info.message)
        err.param = info.param
    return err
