"""The shared structured-output schema checker (``protocols/schema_rules.py``) as a plain function: what it
accepts (every enforced keyword, pydantic's schemas, recursion, a 20,000-value enum) and what it refuses (a 400
naming the keyword, where it is, and the bound)."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field

from meshgate.protocols.model import InvalidRequest
from meshgate.protocols.schema_rules import (
    MAX_DEPTH,
    MAX_ENUM_VALUES,
    MAX_SCHEMA_BYTES,
    REFUSED,
    check_schema,
    enforceable,
)


class Address(BaseModel):
    street: str = Field(min_length=1, max_length=40)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str
    age: int = Field(ge=0, le=130)
    score: float = Field(gt=0, lt=1)
    kind: Literal["a", "b"]
    nick: str | None = None
    addresses: list[Address] = Field(min_length=1, max_length=3)


ACCEPTED = [
    {"type": ["string", "null"]},
    {"type": "string", "nullable": True},
    {"enum": [1, "a", None, {"x": [1]}]},
    {"const": {"a": 1}},
    {"anyOf": [{"type": "integer"}, {"type": "string"}], "title": "t", "description": "d", "default": 1},
    {"oneOf": [{"type": "integer"}], "discriminator": {"propertyName": "x"}, "x-extension": 1},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]},
    {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}}},
    {"$ref": "#/definitions/a", "definitions": {"a": {"type": "integer", "multipleOf": 5}}},
    {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1, "maxProperties": 2},
    {"type": "object", "additionalProperties": False, "patternProperties": {"^a": True}},
    {"type": "array", "prefixItems": [{"type": "integer"}], "items": False, "minItems": 1, "maxItems": 1},
    {"type": "array", "items": [{"type": "integer"}, {"type": "string"}]},
    {"type": "string", "minLength": 1, "maxLength": 100_000, "pattern": "^[a-z]+$", "format": "email"},
    {"type": "number", "minimum": 0, "maximum": 1, "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    {"enum": [f"value-{i}" for i in range(20_000)]},
    Person.model_json_schema(),
]


@pytest.mark.parametrize("schema", ACCEPTED)
def test_enforced_keywords_pass(schema):
    check_schema(schema, "the response format's JSON schema")


@pytest.mark.parametrize("keyword", sorted(REFUSED))
def test_each_unenforced_keyword_is_a_400_naming_it(keyword):
    schema = {"type": "object", "properties": {"a": {"type": "string", keyword: {}}}}
    with pytest.raises(InvalidRequest) as caught:
        check_schema(schema, "tool t's parameters", param="tools")
    assert caught.value.status == 400 and caught.value.param == "tools"
    assert f"the keyword {keyword!r} is not supported" in caught.value.message
    assert caught.value.message.startswith("tool t's parameters: ")
    assert f"(at /properties/a/{keyword.replace('/', '~1')})" in caught.value.message


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "string", "format": "idn-email"}, "the format 'idn-email' is not supported"),
        ({"type": "strin"}, "'type' must be one of"),
        ({"enum": []}, "'enum' must be a non-empty list"),
        ({"type": "number", "minimum": 0, "exclusiveMinimum": True}, "'exclusiveMinimum' must be a number"),
        ({"type": "integer", "multipleOf": 0}, "'multipleOf' must be greater than 0"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "'minimum' is greater than 'maximum'"),
        ({"type": "string", "maxLength": -1}, "'maxLength' must be a whole number"),
        ({"type": "string", "pattern": "^(?=a)a$"}, "look-around"),
        ({"$ref": "https://example.com/s.json"}, "points outside the schema"),
        ({"$ref": "#/$defs/missing"}, "points at nothing in the schema"),
        ({"anyOf": []}, "'anyOf' must be a non-empty list"),
        ({"properties": {"a": 3}}, "a schema must be an object or a boolean"),
        ({"enum": list(range(MAX_ENUM_VALUES + 1))}, f"more than {MAX_ENUM_VALUES:,} values"),
        ({"description": "x" * MAX_SCHEMA_BYTES}, f"at most {MAX_SCHEMA_BYTES:,} are allowed"),
    ],
)
def test_bad_schemas_are_400s_that_say_what_to_fix(schema, words):
    with pytest.raises(InvalidRequest, match="^the format[: ]") as caught:
        check_schema(schema, "the format", param="format")
    assert words in caught.value.message and caught.value.status == 400


def test_nesting_is_bounded_without_recursion():
    deep: dict = {"type": "integer"}
    for _ in range(MAX_DEPTH):
        deep = {"type": "array", "items": deep}
    with pytest.raises(InvalidRequest, match=f"nests more than {MAX_DEPTH} levels"):
        check_schema(deep, "the format")
    for _ in range(100_000):  # far beyond Python's recursion limit: still a 400, not a RecursionError
        deep = {"type": "array", "items": deep}
    with pytest.raises(InvalidRequest, match=f"nests more than {MAX_DEPTH} levels"):
        check_schema(deep, "the format")


def test_a_top_level_that_is_not_an_object_is_refused():
    with pytest.raises(InvalidRequest, match="must be a JSON object"):
        check_schema(True, "the format")


def test_nullable_becomes_an_any_of_with_null_and_the_original_is_left_alone():
    schema = {"type": "object", "properties": {"a": {"type": "string", "nullable": True, "enum": [{"nullable": True}]}}}
    assert enforceable(schema) == {
        "type": "object",
        "properties": {"a": {"anyOf": [{"type": "string", "enum": [{"nullable": True}]}, {"type": "null"}]}},
        "additionalProperties": False,
    }
    assert schema["properties"]["a"]["nullable"] is True and "additionalProperties" not in schema


def test_objects_that_list_their_properties_are_closed_except_in_all_of_and_where_stated():
    schema = {
        "type": "object",
        "properties": {"x": {"type": "object", "properties": {}, "additionalProperties": {"type": "integer"}}},
        "$defs": {"p": {"type": "object", "properties": {"y": {}}, "patternProperties": {"^z": {}}}},
        "items": {
            "properties": {"b": {}},
            "allOf": [{"properties": {"a": {"type": "object", "properties": {}}}}, {"required": ["a"]}],
        },
    }
    out = enforceable(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["x"]["additionalProperties"] == {"type": "integer"}
    assert "additionalProperties" not in out["$defs"]["p"]
    assert "additionalProperties" not in out["items"] and "additionalProperties" not in out["items"]["allOf"][0]
    assert out["items"]["allOf"][0]["properties"]["a"]["additionalProperties"] is False
