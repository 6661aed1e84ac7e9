"""What a JSON schema for structured output may ask for: one pure checker every runner shares.

A schema reaches a runner as a response format (OpenAI ``response_format``, Ollama ``format``) or as a forced
tool call's parameters, and the runner holds generation to it with a grammar (llguidance in the llama.cpp, MLX
and vLLM runners). ``check_schema`` walks the schema once, without recursion, before any grammar is built, and
refuses with ``InvalidRequest`` (400, in each protocol's own error shape) anything the grammar would not enforce
or that is too large to compile quickly, naming the keyword, where it is, and what to change. A schema that passes
is enforced in full: every answer generated under it validates against it.

Enforced keywords:

- ``type`` (one of ``string``, ``number``, ``integer``, ``boolean``, ``object``, ``array``, ``null``, or a list of
  them), ``nullable`` (OpenAPI's ``"nullable": true``), ``enum``, ``const``;
- ``anyOf``, ``oneOf`` (generated as ``anyOf``: branches that overlap may both match), ``allOf`` (merged);
- ``$ref`` to this schema only (``#``, ``#/$defs/...``, ``#/definitions/...``, any JSON pointer into it),
  ``$defs``, ``definitions``, recursion included;
- objects: ``properties``, ``required``, ``additionalProperties`` (``false``, ``true`` or a schema),
  ``patternProperties``, ``minProperties``, ``maxProperties``;
- arrays: ``items`` (a schema, or a list as in draft 4), ``prefixItems``, ``minItems``, ``maxItems``;
- strings: ``minLength``, ``maxLength``, ``pattern`` (no look-around or back-references), ``format`` (one of
  ``FORMATS``: ``date``, ``time``, ``date-time``, ``duration``, ``uuid``, ``email``, ``hostname``, ``ipv4``,
  ``ipv6``, ``uri``);
- numbers: ``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum`` (numbers, as in draft 2020-12;
  draft 4's booleans are refused), ``multipleOf``, for ``integer`` and ``number`` alike.

Annotations that do not constrain a value are accepted and have no effect: ``title``, ``description``,
``default``, ``examples``, ``$schema``, ``$id``, ``$comment``, ``deprecated``, ``readOnly``, ``writeOnly``,
``contentEncoding``, ``contentMediaType``, ``discriminator`` (pydantic's, beside the ``oneOf`` it describes).

Refused (``REFUSED``): the validation keywords no engine enforces: ``not``, ``if``/``then``/``else``,
``dependentRequired``, ``dependentSchemas``, ``dependencies``, ``uniqueItems``, ``contains``, ``minContains``,
``maxContains``, ``propertyNames``, ``unevaluatedProperties``, ``unevaluatedItems``, ``additionalItems``, and the
dynamic references (``$dynamicRef``, ``$recursiveRef``, ``$anchor`` ...). Other keywords, unknown to JSON
Schema, are ignored as the specification says (``x-...``, ``propertyOrdering``).

Bounds (each refusal names the bound): the schema is at most ``MAX_SCHEMA_BYTES`` (2 MiB) of JSON, nests at most
``MAX_DEPTH`` (100) objects and arrays deep, and all its ``enum`` lists hold at most ``MAX_ENUM_VALUES`` (50,000)
values together. Claude Code's ~20 tools are about 60 kB and 8 levels; a 20,000-value enum is about 300 kB; a
grammar for 50,000 short values compiles in well under a second (``benchmarks/grammars.py``).

Imports only ``protocols.model``; pure (no I/O).
"""

from __future__ import annotations

import decimal
import json
from typing import Any

from meshgate.protocols.model import InvalidRequest

__all__ = [
    "ANNOTATIONS",
    "ANY",
    "ENFORCED",
    "FORMATS",
    "FRACTION_DIGITS",
    "JSON_OPTIONS",
    "MAX_DEPTH",
    "MAX_ENUM_VALUES",
    "MAX_SAFE_INTEGER",
    "MAX_SCHEMA_BYTES",
    "NUMBER",
    "REFUSED",
    "SIGNIFICANT_DIGITS",
    "check_schema",
    "enforceable",
]

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False}
"""How every runner has JSON under a schema written (llguidance's JSON options): ``", "`` and ``": "`` between
items, as ``json.dumps`` writes it and as models learnt it, and no other free whitespace."""

MAX_SCHEMA_BYTES = 2 << 20
"""The longest schema, as compact JSON."""

MAX_DEPTH = 100
"""The deepest nesting of JSON objects and arrays in a schema (llguidance's JSON reader stops at 128)."""

MAX_ENUM_VALUES = 50_000
"""All ``enum`` values of one schema together."""

TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})

FORMATS = frozenset({"date", "time", "date-time", "duration", "uuid", "email", "hostname", "ipv4", "ipv6", "uri"})
"""The string formats the grammar enforces."""

ENFORCED = frozenset(
    {
        "type", "nullable", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
        "properties", "required", "additionalProperties", "patternProperties", "minProperties", "maxProperties",
        "items", "prefixItems", "minItems", "maxItems", "minLength", "maxLength", "pattern", "format",
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    }
)  # fmt: skip
"""Keywords held to by the grammar."""

ANNOTATIONS = frozenset(
    {
        "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
        "writeOnly", "contentEncoding", "contentMediaType", "discriminator",
    }
)  # fmt: skip
"""Keywords that describe a value without constraining it."""

REFUSED = frozenset(
    {
        "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "uniqueItems",
        "contains", "minContains", "maxContains", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
        "additionalItems", "$dynamicRef", "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor", "$anchor",
        "$vocabulary",
    }
)  # fmt: skip
"""Validation keywords no grammar here enforces: refused rather than silently not held to."""

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> subschema
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # [subschema]
_SCHEMA_ONE = ("additionalProperties",)  # a subschema (or a boolean)
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def check_schema(schema: Any, what: str, *, param: str | None = None) -> None:
    """Refuse ``schema`` unless every keyword in it is enforced (or an annotation) and it is within the bounds.

    Args:
        schema: The JSON schema, decoded.
        what: What the schema is, for the message ("the response format's JSON schema", "tool get_weather's
            parameters").
        param: The request field to name in the error (``response_format``, ``tools``, ``format``).

    Raises:
        InvalidRequest: (400) naming the keyword, where it is (a JSON pointer) and what to change.
    """

    def refuse(at: str, message: str) -> InvalidRequest:
        return InvalidRequest(f"{what}: {message} (at {at or '/'})", param=param)

    if not isinstance(schema, dict):
        raise InvalidRequest(f"{what} must be a JSON object, not {type(schema).__name__}", param=param)
    try:
        size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode())
    except (ValueError, RecursionError) as exc:  # nested beyond the JSON encoder's own limit
        raise InvalidRequest(
            f"{what} nests more than {MAX_DEPTH} levels deep: flatten it with $defs", param=param
        ) from exc
    if size > MAX_SCHEMA_BYTES:
        raise InvalidRequest(
            f"{what} is {size:,} bytes of JSON; at most {MAX_SCHEMA_BYTES:,} are allowed: shorten it", param=param
        )
    enum_values = 0
    # (node, JSON pointer, JSON depth, whether node is a schema); a plain-data node (an enum value) is only measured
    stack: list[tuple[Any, str, int, bool]] = [(schema, "", 1, True)]
    while stack:
        node, at, depth, is_schema = stack.pop()
        if depth > MAX_DEPTH:
            raise refuse(at, f"the schema nests more than {MAX_DEPTH} levels deep: flatten it with $defs")
        if not is_schema:
            children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
            stack.extend((child, at, depth + 1, False) for child in children)
            continue
        if isinstance(node, bool):
            continue  # true: anything; false: nothing
        if not isinstance(node, dict):
            raise refuse(at, f"a schema must be an object or a boolean, not {type(node).__name__}")
        for key, value in node.items():
            here = f"{at}/{_escape(key)}"
            if key in REFUSED:
                raise refuse(
                    here, f"the keyword {key!r} is not supported in structured output: remove it or use only {_HINT}"
                )
            if key in _SCHEMA_MAPS:
                if not isinstance(value, dict):
                    raise refuse(here, f"{key!r} must be an object mapping names to schemas")
                stack.extend((sub, f"{here}/{_escape(name)}", depth + 2, True) for name, sub in value.items())
            elif key in _SCHEMA_LISTS:
                if not isinstance(value, list) or (key != "prefixItems" and not value):
                    raise refuse(here, f"{key!r} must be a non-empty list of schemas")
                stack.extend((sub, f"{here}/{i}", depth + 2, True) for i, sub in enumerate(value))
            elif key == "items":
                if isinstance(value, list):
                    stack.extend((sub, f"{here}/{i}", depth + 2, True) for i, sub in enumerate(value))
                else:
                    stack.append((value, here, depth + 1, True))
            elif key in _SCHEMA_ONE:
                stack.append((value, here, depth + 1, True))
            elif key == "type":
                kinds = value if isinstance(value, list) else [value]
                if not kinds or any(not isinstance(k, str) or k not in TYPES for k in kinds):
                    raise refuse(
                        here, f"'type' must be one of {', '.join(sorted(TYPES))} or a list of them, not {value!r}"
                    )
            elif key == "enum":
                if not isinstance(value, list) or not value:
                    raise refuse(here, "'enum' must be a non-empty list of values")
                enum_values += len(value)
                if enum_values > MAX_ENUM_VALUES:
                    raise refuse(
                        here, f"the schema's enums hold more than {MAX_ENUM_VALUES:,} values: use fewer or a 'pattern'"
                    )
                stack.append((value, here, depth + 1, False))
            elif key == "const":
                stack.append((value, here, depth, False))
            elif key in ("default", "examples"):
                stack.append((value, here, depth, False))
            elif key == "required":
                if not isinstance(value, list) or any(not isinstance(name, str) for name in value):
                    raise refuse(here, "'required' must be a list of property names")
            elif key in _COUNTS:
                if isinstance(value, bool) or not isinstance(value, int | float) or value < 0 or value != int(value):
                    raise refuse(here, f"{key!r} must be a whole number of at least 0, not {value!r}")
            elif key in _NUMBERS:
                if isinstance(value, bool):
                    raise refuse(
                        here,
                        f"{key!r} must be a number (draft 2020-12), not a boolean: write 'exclusiveMinimum: 0' for "
                        "'minimum: 0, exclusiveMinimum: true'",
                    )
                if not isinstance(value, int | float):
                    raise refuse(here, f"{key!r} must be a number, not {value!r}")
                if key == "multipleOf" and value <= 0:
                    raise refuse(here, f"'multipleOf' must be greater than 0, not {value!r}")
            elif key == "pattern":
                if not isinstance(value, str):
                    raise refuse(here, "'pattern' must be a regular expression in a string")
                if any(look in value for look in ("(?=", "(?!", "(?<=", "(?<!")):
                    raise refuse(here, "'pattern' uses look-around ((?=, (?!, (?<=, (?<!), which is not supported")
            elif key == "format":
                if value not in FORMATS:
                    raise refuse(
                        here,
                        f"the format {value!r} is not supported: use one of {', '.join(sorted(FORMATS))} "
                        "or a 'pattern'",
                    )
            elif key == "nullable":
                if not isinstance(value, bool):
                    raise refuse(here, "'nullable' must be true or false")
            elif key == "$ref":
                _check_ref(schema, value, here, refuse)
        if "minimum" in node and "maximum" in node and _number(node["minimum"]) > _number(node["maximum"]):
            raise refuse(at, "'minimum' is greater than 'maximum': no value fits")
    return None


def enforceable(schema: dict[str, Any], *, steps: bool = True) -> dict[str, Any]:
    """A copy of a checked ``schema`` in the form grammar compilers take, with every run a small model could fall
    into bounded where a JSON consumer would not notice (``docs/endpoints.md``, "Structured output: what is
    bounded"). Walked without recursion, schema by schema (a property named ``type`` or ``nullable`` is a name):

    - OpenAPI's ``"nullable": true`` (which llguidance ignores) becomes ``anyOf`` the schema and ``{"type": "null"}``.
    - An object schema that lists ``properties`` and says nothing of others (no ``additionalProperties`` or
      ``patternProperties``) gets ``"additionalProperties": false``, as llama.cpp's and Ollama's converters and
      OpenAI's strict mode hold it: every answer still validates against the schema as sent, and a small model
      does not invent property after property until ``max_tokens`` cuts the JSON off. Not inside ``allOf``, whose
      branches are merged and each list only some of the properties.
    - An ``integer`` with no bound on a side is held to ``MAX_SAFE_INTEGER`` (16 digits) on that side; a
      ``number`` to ``SIGNIFICANT_DIGITS`` significant digits, at most ``FRACTION_DIGITS`` of them decimals,
      written without an exponent (``_BY_SIZE``, beside the bounds the schema gives; a number that says nothing
      more refers to the one ``NUMBER`` entry added to ``$defs``). A schema that gives its
      own ``multipleOf``, or a bound beyond these, keeps it: a number then gets only the sides and the step it
      lacks (below 10^15 in size, ``FRACTION_DIGITS`` decimals), and a side whose given bound lies beyond the
      default is left as given. The packaged model loves digits: without this it wrote 26-digit integers until
      ``max_tokens`` cut the call off before its next required key, and it fills whatever room a bound leaves.
    - A value the schema leaves open (``true``, ``{}``, a schema of annotations only, the values of an object
      that lists no ``properties``, the items of an array with no ``items``; ``json_object``'s ``{"type":
      "object"}``) is any JSON value whose numbers are bounded as above, at every depth (``ANY``, a ``$defs``
      entry added to the copy). Not inside ``allOf`` branches, which the compilers merge.

    ``steps=False`` leaves ``multipleOf`` out of what is added, for llguidance before 1.9 (vLLM 0.32 pins 1.7.6),
    where any ``multipleOf`` refuses every negative number: a number there is bounded in size only (below 10^15,
    no exponent), its decimals left to the model.

    Unbounded on purpose: strings (no ``maxLength``), arrays (no ``maxItems``) and the keys of open objects. A
    bound a small model would notice would cut real answers, and ``max_tokens`` ends them either way; whitespace
    is bounded by the JSON options (``JSON_OPTIONS``: none free under a schema).
    """
    copy: dict[str, Any] = json.loads(json.dumps(schema))
    used: set[str] = set()  # the $defs entries added (ANY, NUMBER)

    def is_open(sub: Any) -> bool:
        return sub is True or (isinstance(sub, dict) and all(key in ANNOTATIONS for key in sub))

    def child(sub: Any, in_all_of: bool) -> Any:
        """``sub`` as it should stand, pushed to be walked; an open value becomes a reference to ``ANY``."""
        if is_open(sub) and not in_all_of:
            used.add(ANY)
            return {**(sub if isinstance(sub, dict) else {}), "$ref": _ref(ANY)}
        stack.append((sub, in_all_of))
        return sub

    stack: list[tuple[Any, bool]] = [(copy, False)]  # (schema, whether it is a branch of allOf)
    while stack:
        node, in_all_of = stack.pop()
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                for name, sub in value.items():
                    value[name] = child(sub, False)
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                value[:] = [child(sub, key == "allOf") for sub in value]
            elif key == "items" and isinstance(value, list):
                value[:] = [child(sub, False) for sub in value]
            elif key in ("items", "additionalProperties"):
                node[key] = child(value, False)
        kinds = node.get("type")
        kinds = set(kinds) if isinstance(kinds, list) else {kinds}
        if not in_all_of and "allOf" not in node:
            if "properties" in node and "additionalProperties" not in node and "patternProperties" not in node:
                node["additionalProperties"] = False
            elif "object" in kinds and "additionalProperties" not in node:
                node["additionalProperties"] = child(True, False)
            if "array" in kinds and "items" not in node:
                node["items"] = child(True, False)
        if steps and node.get("type") == "number" and all(k in _PLAIN_NUMBER for k in node):
            del node["type"]  # a number bounded by nothing of its own: the one NUMBER, compiled once
            node["$ref"] = _ref(NUMBER)
            used.add(NUMBER)
        elif kinds & {"integer", "number"} and "enum" not in node and "const" not in node:
            _bound_numbers(node, "number" in kinds, steps)
        if node.pop("nullable", False) is True:
            inner = dict(node)
            node.clear()
            node["anyOf"] = [inner, {"type": "null"}]
    if used:
        defs = copy.setdefault("$defs", {})
        number: dict[str, Any] = {"type": "number"}
        _bound_numbers(number, True, steps)
        if NUMBER in used or (ANY in used and steps):
            defs[NUMBER], number = number, {"$ref": _ref(NUMBER)}
        if ANY in used:
            defs[ANY] = {
                "anyOf": [
                    {"type": ["string", "boolean", "null"]},
                    number,
                    {"type": "array", "items": {"$ref": _ref(ANY)}},
                    {"type": "object", "additionalProperties": {"$ref": _ref(ANY)}},
                ]
            }
    return copy


MAX_SAFE_INTEGER = 2**53 - 1
"""The largest integer a schema leaves unbounded may reach (either sign): the largest every JSON consumer holds
exactly (JavaScript's ``Number.MAX_SAFE_INTEGER``, 16 digits, as llama.cpp's converter allows 16)."""

SIGNIFICANT_DIGITS = 15
"""The most significant digits of a number a schema leaves unbounded: what a double holds exactly (``DBL_DIG``)."""

FRACTION_DIGITS = 10
"""The most decimals of such a number (``1e-10`` is the finest step llguidance holds exactly)."""

ANY = "meshgate-any"
"""The ``$defs`` entry ``enforceable`` adds for a value a schema leaves open."""

NUMBER = "meshgate-number"
"""The ``$defs`` entry ``enforceable`` adds for a number bounded by nothing of its own: every such number refers to
it, so its ``anyOf`` compiles once (20 numbers inline took 69 ms to compile, 4 ms by reference;
``benchmarks/number_bounds.py``)."""

_PLAIN_NUMBER = ANNOTATIONS | {"type", "nullable"}
_SIZE = 10**SIGNIFICANT_DIGITS  # a number without an exponent and SIGNIFICANT_DIGITS digits is below this
_BY_SIZE = [
    {
        "exclusiveMinimum": -(10**size),
        "exclusiveMaximum": 10**size,
        "multipleOf": float(f"1e-{SIGNIFICANT_DIGITS - size}") if size < SIGNIFICANT_DIGITS else 1,
    }
    for size in range(SIGNIFICANT_DIGITS - FRACTION_DIGITS, SIGNIFICANT_DIGITS + 1)
]
"""A number of at most ``SIGNIFICANT_DIGITS`` digits, as one branch per count of digits before the point (fewer
than 10^size, to ``SIGNIFICANT_DIGITS - size`` decimals)."""


def _bound_numbers(node: dict[str, Any], fractional: bool, steps: bool) -> None:
    """Add the default bounds a numeric ``node`` does not give itself (see ``enforceable``)."""
    lower = [node[k] for k in ("minimum", "exclusiveMinimum") if k in node]
    upper = [node[k] for k in ("maximum", "exclusiveMaximum") if k in node]
    if not fractional:
        if not lower and all(bound > -MAX_SAFE_INTEGER for bound in upper):
            node["minimum"] = -MAX_SAFE_INTEGER
        if not upper and all(bound < MAX_SAFE_INTEGER for bound in lower):
            node["maximum"] = MAX_SAFE_INTEGER
        return
    within = all(-_SIZE < bound < _SIZE and _exponent(bound) >= -FRACTION_DIGITS for bound in lower + upper)
    if steps and within and "multipleOf" not in node and "anyOf" not in node:
        node["anyOf"] = [dict(branch) for branch in _BY_SIZE]  # the node's own bounds hold beside them
        return
    if not lower and all(bound > -_SIZE for bound in upper):  # a step or bounds of the schema's own: keep them
        node["exclusiveMinimum"] = -_SIZE
    if not upper and all(bound < _SIZE for bound in lower):
        node["exclusiveMaximum"] = _SIZE
    if steps and "multipleOf" not in node and all(_exponent(bound) >= -FRACTION_DIGITS for bound in lower + upper):
        node["multipleOf"] = float(f"1e-{FRACTION_DIGITS}")


def _exponent(bound: int | float) -> int:
    """The decimal exponent of ``bound``'s last digit as JSON writes it (``0.25`` -> -2, ``3`` -> 0)."""
    exponent = decimal.Decimal(repr(bound)).as_tuple().exponent
    return exponent if isinstance(exponent, int) else 0


def _ref(name: str) -> str:
    return f"#/$defs/{name}"


_HINT = "enforced keywords (see docs/protocols.md, structured output)"


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def _escape(key: str) -> str:
    """``key`` as a JSON pointer segment."""
    return str(key).replace("~", "~0").replace("/", "~1")


def _check_ref(root: dict[str, Any], ref: Any, at: str, refuse: Any) -> None:
    """A ``$ref`` must point into ``root`` (``#`` or ``#/a/b``), at something that is there."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        raise refuse(at, f"'$ref' {ref!r} points outside the schema: only local references (#/$defs/...) are allowed")
    node: Any = root
    for part in ref[2:].split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise refuse(at, f"'$ref' {ref!r} points at nothing in the schema: define it under $defs")
