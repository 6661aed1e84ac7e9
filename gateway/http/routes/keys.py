"""The keys API (admin scope): ``GET /keys``, ``POST /keys``, ``DELETE /keys/{id}``. ``meshgate keys`` uses it.

A made key is shown once, in the ``POST`` answer; listings show the records (id, name, scope, models, limits,
tenant, priority class and weight), never a key or its digest. ``priority`` (``interactive`` or ``batch``) is the
class of the key's requests that send no ``service_tier`` (unset: ``MESHGATE_DEFAULT_PRIORITY``); ``weight`` its
share of the slots against other keys of the same class (``gateway.serving.admission``). Keys of one ``tenant``
share cached prompts (``MESHGATE_KV_SHARING``); a key without one shares them with no other key. Errors use
OpenAI's envelope, as the cluster API does.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from litestar import Response, Router, delete, get, post
from litestar.di import NamedDependency

from meshgate.gateway.auth.guard import KeyRing, mint
from meshgate.gateway.auth.keys import ApiKey, Scope
from meshgate.gateway.http.routes.common import body, json_response
from meshgate.protocols.model import NotFound, Priority

_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.@ -]*$")]
_Limit = Annotated[int, msgspec.Meta(ge=0, le=10**9)]


class CreateKey(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: _Name
    scope: Scope = "inference"
    models: tuple[Annotated[str, msgspec.Meta(min_length=1, max_length=256)], ...] = ()
    rpm: _Limit = 0
    tpm: _Limit = 0
    tenant: Annotated[str, msgspec.Meta(max_length=64, pattern=r"^([A-Za-z0-9][A-Za-z0-9_.@ -]*)?$")] = ""
    priority: Priority | None = None
    weight: Annotated[float, msgspec.Meta(gt=0, le=1000)] = 1.0


class KeyView(msgspec.Struct, frozen=True, kw_only=True):
    """A stored key as listed: everything but its digest."""

    id: str
    name: str
    scope: Scope
    models: tuple[str, ...]
    rpm: int
    tpm: int
    created: float
    tenant: str
    priority: Priority | None
    weight: float


class NewKey(KeyView, frozen=True, kw_only=True):
    key: str  # shown once


def _view(key: ApiKey) -> dict:
    return {name: getattr(key, name) for name in KeyView.__struct_fields__}


Ring = NamedDependency[KeyRing]  # the app's ``keyring`` dependency (``common.provide_keyring``)


@get("/keys", summary="API keys (never the keys themselves)")
async def list_keys(keyring: Ring) -> Response[bytes]:
    keys = await keyring.accounts.keys()
    return json_response(msgspec.json.encode({"keys": [KeyView(**_view(k)) for k in keys]}))


@post(
    "/keys",
    summary="Make an API key; the answer is the only time it is shown",
    status_code=201,
    dependencies=body(CreateKey),
)
async def create_key(keyring: Ring, wire: NamedDependency[CreateKey]) -> Response[bytes]:
    secret, record = mint(
        wire.name, wire.scope, wire.models, wire.rpm, wire.tpm, wire.tenant, priority=wire.priority, weight=wire.weight
    )
    await keyring.accounts.put_key(record)
    return json_response(msgspec.json.encode(NewKey(**_view(record), key=secret)), status=201)


@delete("/keys/{key_id:str}", summary="Revoke an API key", status_code=204)
async def revoke_key(keyring: Ring, key_id: str) -> None:
    if not await keyring.accounts.delete_key(key_id):
        raise NotFound(f"no key with id {key_id!r}", param="key_id")


router = Router(
    path="/",
    route_handlers=[list_keys, create_key, revoke_key],
    tags=["keys"],
    opt={"scope": "admin"},
)
