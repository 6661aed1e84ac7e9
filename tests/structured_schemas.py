"""Schemas the MLX and vLLM structured-output tests hold their tiny random models to: bounded integers, an enum,
OpenAPI ``nullable``, and a recursive ``$defs`` (a linked list of at least two items: the random tiny models nest a
tree without end, not this)."""

from __future__ import annotations

PICK = {
    "type": "object",
    "properties": {
        "count": {"type": "integer", "minimum": 3, "maximum": 7},
        "color": {"enum": ["red", "green", "blue"]},
        "note": {"type": "string", "maxLength": 5, "nullable": True},
    },
    "required": ["count", "color", "note"],
    "additionalProperties": False,
}
ITEM = {
    "type": "object",
    "properties": {
        "v": {"type": "integer", "minimum": 0, "maximum": 9},
        "next": {"anyOf": [{"$ref": "#/$defs/item"}, {"type": "null"}]},
    },
    "required": ["v", "next"],
    "additionalProperties": False,
}
LIST = {
    "$defs": {"item": ITEM},
    **ITEM,
    "properties": {"v": ITEM["properties"]["v"], "next": {"$ref": "#/$defs/item"}},
}
