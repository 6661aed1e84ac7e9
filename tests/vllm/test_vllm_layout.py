"""The vLLM backend's pure parts, without vLLM: placement records as vLLM's sizes, Ray node ids that sort by
stage, and the bind shim that keeps Ray's ports on the cluster address (compiled and preloaded for real)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from meshgate.backends.placement import Candidate, NodeId, Shard
from meshgate.backends.runner import bindshim
from meshgate.backends.vllm.launch import layout, threads_bind
from meshgate.backends.vllm.raynode import stage, stage_env
from tests.cluster.sockets import listening


def placement(strategy: str, *shards: Shard) -> Candidate:
    return Candidate(
        id="p",
        model="m",
        backend="vllm",
        strategy=strategy,  # type: ignore[arg-type]
        context=512,
        shards=shards,
        memory_per_node={},
    )


def shard(node: str, start: int, end: int, rank: int = 0, size: int = 1) -> Shard:
    return Shard(node_id=NodeId(node), layer_start=start, layer_end=end, tensor_rank=rank, tensor_size=size)


def test_one_node_runs_the_mp_executor_and_many_run_ray() -> None:
    single = layout(placement("single", shard("a", 0, 18)), tensor_per_node=2)
    assert (single.tensor, single.pipeline, single.ray, single.ranks) == (2, 1, False, {"a": 2})
    local = layout(placement("pipeline", shard("a", 0, 7), shard("a", 7, 18)))
    assert (local.pipeline, local.ray, local.layers) == (2, False, (7, 11))
    spread = layout(placement("pipeline", shard("b", 9, 18), shard("a", 0, 9)), tensor_per_node=2)
    assert (spread.tensor, spread.pipeline, spread.ray, spread.head) == (2, 2, True, "a")
    assert spread.ranks == {"b": 2, "a": 2} and spread.layers == (9, 9)


def test_ray_node_ids_sort_in_stage_order_whatever_the_node_names() -> None:
    record = placement("pipeline", shard("zeta", 12, 18), shard("alpha", 6, 12), shard("mid", 0, 6))
    assert [stage(record, NodeId(n)) for n in ("mid", "alpha", "zeta")] == [0, 1, 2]
    ids = {n: stage_env(stage(record, NodeId(n)))["RAY_OVERRIDE_NODE_ID_FOR_TESTING"] for n in ("zeta", "alpha")}
    assert all(len(i) == 56 and int(i, 16) >= 0 for i in ids.values())  # Ray's NodeID: 28 bytes in hex
    assert sorted(ids, key=ids.get) == ["alpha", "zeta"]  # vLLM's order after the driver's node
    assert stage_env(1) != stage_env(1)  # otherwise random: two placements never share an id


def test_threads_bind_gives_each_worker_its_own_cpus() -> None:
    assert threads_bind(2, [0, 1, 2, 3]) == "0,1|2,3"
    assert threads_bind(3, [0, 1]) == "0|1|0"


BIND_ANY = """
import socket, sys, time
family = socket.AF_INET6 if sys.argv[1] == "::" else socket.AF_INET
s = socket.socket(family)
s.bind((sys.argv[1], 0))
s.listen()
print(s.getsockname()[0], flush=True)
time.sleep(30)
"""


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::"])
def test_the_bind_shim_moves_a_wildcard_listener_to_the_cluster_address(tmp_path: Path, wildcard: str) -> None:
    library = bindshim.build(tmp_path)
    assert bindshim.build(tmp_path) == library  # built once per folder
    env = bindshim.confine({"PATH": "/usr/bin:/bin"}, library, "127.0.0.2")
    assert env["MESHGATE_BIND_HOST"] == "127.0.0.2" and env["LD_PRELOAD"] == str(library)
    child = subprocess.Popen([sys.executable, "-c", BIND_ANY, wildcard], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        bound = child.stdout.readline().strip()
        assert bound in ("127.0.0.2", "::ffff:127.0.0.2"), bound
        assert {address for address, _ in listening([child.pid])} == {"127.0.0.2"}
    finally:
        child.kill()
        child.wait()


def test_the_bind_shim_leaves_explicit_addresses_and_fails_closed(tmp_path: Path) -> None:
    library = bindshim.build(tmp_path)
    explicit = subprocess.run(
        [sys.executable, "-c", BIND_ANY.replace("time.sleep(30)", ""), "127.0.0.1"],
        env=bindshim.confine({}, library, "127.0.0.2"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert explicit.stdout.strip() == "127.0.0.1"
    # an IPv6 cluster address cannot take an IPv4 wildcard bind: it fails rather than listen everywhere
    refused = subprocess.run(
        [sys.executable, "-c", BIND_ANY, "0.0.0.0"],
        env=bindshim.confine({}, library, "::1"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert refused.returncode != 0 and "Cannot assign requested address" in refused.stderr


def test_structured_requests_reach_vllm_in_the_form_llguidance_reads() -> None:
    """Response formats go as schemas with the shared JSON options and ``nullable`` spelled out; forced tools keep
    their schemas; what vLLM would not enforce is refused naming the field."""
    from meshgate.backends.vllm.runner import JSON_OPTIONS, structured
    from meshgate.protocols.model import InvalidRequest, Request, ResponseFormat, Tool, ToolChoice
    from meshgate.protocols.schema_rules import ANY, MAX_SAFE_INTEGER, enforceable

    base = Request(model="m", raw_prompt="x")
    sent = structured(msgspec_replace(base, response_format=ResponseFormat(kind="json_object")))
    assert sent.response_format.kind == "json_schema"
    assert sent.response_format.schema == {**enforceable({"type": "object"}, steps=False), "x-guidance": JSON_OPTIONS}
    any_number = sent.response_format.schema["$defs"][ANY]["anyOf"][1]  # open values: numbers bounded, no step
    assert any_number == {"type": "number", "exclusiveMinimum": -(10**15), "exclusiveMaximum": 10**15}
    nullable = {"type": "object", "properties": {"a": {"type": "string", "nullable": True}}, "x-guidance": {}}
    sent = structured(msgspec_replace(base, response_format=ResponseFormat(kind="json_schema", schema=nullable)))
    theirs_replaced = {**enforceable(nullable, steps=False), "x-guidance": JSON_OPTIONS}
    assert sent.response_format.schema == theirs_replaced
    assert sent.response_format.schema["properties"]["a"] == {"anyOf": [{"type": "string"}, {"type": "null"}]}
    tool = Tool(name="t", parameters={"type": "object", "properties": {"n": {"type": "integer", "nullable": True}}})
    forced = structured(msgspec_replace(base, tools=(tool,), tool_choice=ToolChoice(mode="tool", name="t")))
    assert forced.tools[0].parameters == enforceable(tool.parameters, steps=False)
    bounded = {"type": "integer", "minimum": -MAX_SAFE_INTEGER, "maximum": MAX_SAFE_INTEGER}
    assert forced.tools[0].parameters["properties"]["n"] == {"anyOf": [bounded, {"type": "null"}]}
    one = structured(msgspec_replace(base, tools=(tool,), tool_choice=ToolChoice(mode="required")))
    assert (one.tool_choice.mode, one.tool_choice.name) == ("tool", "t")  # the one call required allows
    two = (tool, Tool(name="u", parameters={"type": "object"}))
    both = structured(msgspec_replace(base, tools=two, tool_choice=ToolChoice(mode="required")))
    assert both.tool_choice.mode == "required"
    with pytest.raises(InvalidRequest) as auto:
        structured(msgspec_replace(base, tools=(tool,)))
    assert auto.value.param == "tool_choice"
    bad = Tool(name="t", parameters={"type": "array", "uniqueItems": True})
    with pytest.raises(InvalidRequest) as keyword:
        structured(msgspec_replace(base, tools=(bad,), tool_choice=ToolChoice(mode="required")))
    assert keyword.value.param == "tools" and "'uniqueItems'" in str(keyword.value)


def msgspec_replace(request: object, **changes: object) -> object:
    import msgspec

    return msgspec.structs.replace(request, **changes)  # type: ignore[type-var]
