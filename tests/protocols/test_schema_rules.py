"""The shared structured-output schema checker (``protocols/schema_rules.py``) as a plain function: what it
accepts (every enforced keyword, pydantic's schemas, recursion, a 20,000-value enum) and what it refuses (a 400
naming the keyword, where it is, and the bound)."""

from __future__ import annotations

from decimal import Decimal
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from meshgate.protocols.model import InvalidRequest
from meshgate.protocols.schema_rules import (
    ANY,
    FRACTION_DIGITS,
    MAX_DEPTH,
    MAX_ENUM_VALUES,
    MAX_SAFE_INTEGER,
    MAX_SCHEMA_BYTES,
    NUMBER,
    REFUSED,
    SIGNIFICANT_DIGITS,
    check_schema,
    enforceable,
)

ANY_REF = f"#/$defs/{ANY}"
NUMBER_REF = f"#/$defs/{NUMBER}"


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
    assert out["properties"]["x"]["additionalProperties"]["type"] == "integer"
    assert out["$defs"]["p"]["additionalProperties"] == {"$ref": ANY_REF}  # open, its numbers bounded
    assert "additionalProperties" not in out["items"] and "additionalProperties" not in out["items"]["allOf"][0]
    assert out["items"]["allOf"][0]["properties"]["a"]["additionalProperties"] is False


# ------------------------------------------------------------------------------ what enforceable bounds (issue 36)

SAFE = MAX_SAFE_INTEGER


def _by_size(node: dict) -> list[tuple[int, float]]:
    """A bounded number's branches as (exclusive size bound, step)."""
    return [(branch["exclusiveMaximum"], branch["multipleOf"]) for branch in node["anyOf"]]


def test_an_integer_with_no_bounds_is_held_to_what_json_consumers_hold_exactly():
    out = enforceable({"type": "object", "properties": {"days": {"type": "integer"}}, "required": ["days"]})
    assert out["properties"]["days"] == {"type": "integer", "minimum": -SAFE, "maximum": SAFE}
    assert SAFE == 9007199254740991 and len(str(SAFE)) == 16


def test_an_integer_keeps_the_bounds_it_gives_and_gets_the_missing_side():
    assert enforceable({"type": "integer", "minimum": 1, "maximum": 5}) == {
        "type": "integer",
        "minimum": 1,
        "maximum": 5,
    }
    assert enforceable({"type": "integer", "exclusiveMinimum": 0}) == {
        "type": "integer",
        "exclusiveMinimum": 0,
        "maximum": SAFE,
    }
    beyond = {"type": "integer", "minimum": 10**17}  # a given bound beyond the default: that side stays as given
    assert enforceable(beyond) == beyond
    assert enforceable({"type": "integer", "enum": [10**20]}) == {"type": "integer", "enum": [10**20]}
    either = enforceable({"type": ["integer", "null"]})
    assert either["minimum"] == -SAFE and either["maximum"] == SAFE


def test_a_number_has_at_most_fifteen_significant_digits_and_ten_decimals():
    out = enforceable(
        {"type": "object", "properties": {"a": {"type": "number", "description": "A"}, "b": {"type": "number"}}}
    )
    assert out["properties"] == {"a": {"description": "A", "$ref": NUMBER_REF}, "b": {"$ref": NUMBER_REF}}  # one def
    number = out["$defs"][NUMBER]
    assert number["type"] == "number" and set(number) == {"type", "anyOf"}
    branches = _by_size(number)
    assert branches[0] == (10 ** (SIGNIFICANT_DIGITS - FRACTION_DIGITS), 1e-10)  # below 100000: ten decimals
    assert branches[-1] == (10**SIGNIFICANT_DIGITS, 1)  # 15 digits before the point: none after it
    # digits before the point (size has one more) and after it (the step's) make fifteen in every branch
    assert all(len(str(size)) - 1 - Decimal(repr(step)).as_tuple().exponent == 15 for size, step in branches)
    probability = enforceable({"type": "number", "minimum": 0, "maximum": 1})  # its bounds hold beside the branches
    assert probability["minimum"] == 0 and probability["maximum"] == 1 and _by_size(probability) == branches
    nullable = enforceable({"type": "number", "nullable": True})
    assert nullable["anyOf"] == [{"$ref": NUMBER_REF}, {"type": "null"}] and NUMBER in nullable["$defs"]
    unstepped = enforceable({"type": "number"}, steps=False)  # for vLLM's llguidance: sizes only, inline
    assert unstepped == {"type": "number", "exclusiveMinimum": -(10**15), "exclusiveMaximum": 10**15}


def test_a_number_with_a_step_or_bounds_of_its_own_keeps_them():
    assert enforceable({"type": "number", "multipleOf": 0.5}) == {
        "type": "number",
        "multipleOf": 0.5,
        "exclusiveMinimum": -(10**SIGNIFICANT_DIGITS),
        "exclusiveMaximum": 10**SIGNIFICANT_DIGITS,
    }
    big = enforceable({"type": "number", "minimum": 0, "maximum": 1e17})
    assert big == {"type": "number", "minimum": 0, "maximum": 1e17, "multipleOf": 1e-10}
    fine = enforceable({"type": "number", "minimum": 1e-12, "maximum": 1})  # finer than the default step: none
    assert fine == {"type": "number", "minimum": 1e-12, "maximum": 1}


def test_open_values_become_any_value_with_bounded_numbers_at_every_depth():
    out = enforceable({"type": "object"})  # json_object, Ollama's format "json"
    assert out["additionalProperties"] == {"$ref": ANY_REF}
    any_value = out["$defs"][ANY]["anyOf"]
    assert {"type": "array", "items": {"$ref": ANY_REF}} in any_value
    assert {"type": "object", "additionalProperties": {"$ref": ANY_REF}} in any_value
    assert {"$ref": NUMBER_REF} in any_value and out["$defs"][NUMBER]["anyOf"]
    listed = enforceable(
        {
            "type": "object",
            "properties": {"x": {}, "y": True, "z": {"description": "anything"}, "tags": {"type": "array"}},
            "$defs": {"free": {"type": "object", "additionalProperties": True}},
        }
    )
    props = listed["properties"]
    assert props["x"] == props["y"] == {"$ref": ANY_REF} and props["z"] == {"description": "anything", "$ref": ANY_REF}
    assert props["tags"]["items"] == {"$ref": ANY_REF}
    assert listed["$defs"]["free"]["additionalProperties"] == {"$ref": ANY_REF}
    assert ANY not in enforceable({"type": "object", "properties": {"a": {"type": "string"}}}).get("$defs", {})


def test_property_names_are_names_not_keywords():
    """A property called ``nullable``, ``type`` or ``properties`` is not read as the keyword."""
    schema = {
        "type": "object",
        "properties": {
            "nullable": {"type": "boolean"},
            "type": {"type": "integer"},
            "properties": {"type": "string"},
        },
    }
    out = enforceable(schema)
    assert set(out["properties"]) == {"nullable", "type", "properties"}
    assert out["properties"]["nullable"] == {"type": "boolean"}
    assert out["properties"]["type"]["maximum"] == SAFE
    assert out["additionalProperties"] is False and "additionalProperties" not in out["properties"]


def test_all_of_branches_are_merged_by_the_compiler_and_left_open():
    schema = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]}
    out = enforceable(schema)
    first = out["allOf"][0]
    assert "additionalProperties" not in first and first["properties"]["a"]["maximum"] == SAFE
