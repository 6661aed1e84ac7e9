"""The MLX backend's pieces: the tiny test model, the engine, the runner, two ranks over the ring backend.

Everything MLX runs in subprocesses of the MLX venv's python (``.cache/venvs/mlx``, made by the first test run
with ``mlx[cpu]``, ``mlx-lm[cpu]`` and the runner's own needs; ``MESHGATE_MLX_PYTHON`` points at another), with
``PYTHONPATH`` at the repo root. Every process is bounded by a timeout and killed on the way out.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.structured_schemas import LIST, PICK

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}

sys.path.insert(0, str(ROOT))


@functools.cache
def mlx_python() -> Path:
    if os.environ.get("MESHGATE_MLX_PYTHON"):
        return Path(os.environ["MESHGATE_MLX_PYTHON"])
    from tests.compat.venvs import mlx_venv

    return mlx_venv()


def _mlx(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [str(mlx_python()), *args], env=ENV, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done


FAMILIES = ("llama", "gemma3")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model of each family, by family."""
    root = tmp_path_factory.mktemp("tiny-mlx")
    for family in FAMILIES:
        _mlx(str(HERE / "tiny_model.py"), str(root / family), family)
    return {family: root / family for family in FAMILIES}


@pytest.fixture(scope="module")
def tiny(models: dict[str, Path]) -> Path:
    return models["llama"]


def _checks(runs: list[dict], n: int, max_tokens: int = 32) -> list[dict]:
    """Run ``rank_check.py`` over ``runs`` on ``n`` ranks (one launch for all); each rank's report, rank order."""
    from meshgate.backends.mlx.launch import launch

    started = time.monotonic()
    argv = [str(mlx_python()), str(HERE / "rank_check.py"), json.dumps(runs), str(max_tokens)]
    ranks = launch(n, argv, env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        outs = [p.communicate(timeout=240) for p in ranks.procs]
        codes = [p.returncode for p in ranks.procs]
    finally:
        ranks.close()
    assert codes == [0] * n, [err[-1500:] for _, err in outs]
    print(f"{len(runs)} runs on {n} ranks: {time.monotonic() - started:.1f} s")
    return [json.loads(out.splitlines()[-1]) for out, _ in outs]


@pytest.fixture(scope="module")
def one_rank(models: dict[str, Path]) -> dict[str, dict]:
    """Each family's whole model in one process: the reference every sharding must reproduce."""
    (report,) = _checks([{"model": str(models[f]), "mode": "single"} for f in FAMILIES], 1)
    return dict(zip(FAMILIES, report["runs"], strict=True))


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_model_builds_byte_identical(models: dict[str, Path], tmp_path: Path, family: str) -> None:
    tiny, again = models[family], tmp_path / "again"
    _mlx(str(HERE / "tiny_model.py"), str(again), family)
    names = sorted(p.name for p in tiny.iterdir())
    assert "model.safetensors.index.json" in names and "tokenizer.json" in names
    assert all((tiny / n).read_bytes() == (again / n).read_bytes() for n in names)
    config = json.loads((tiny / "config.json").read_text())
    if family == "gemma3":  # shaped like Gemma 3 270M where sharding cares; a window the prompts outgrow
        assert (config["num_attention_heads"], config["num_key_value_heads"], config["sliding_window"]) == (4, 1, 8)
        assert config["tie_word_embeddings"] and not any(
            "lm_head" in n for n in json.loads((tiny / "model.safetensors.index.json").read_text())["weight_map"]
        )


def test_engine_matches_mlx_lm_generate(models: dict[str, Path], one_rank: dict[str, dict]) -> None:
    script = (
        "import sys, json; from mlx_lm import load; from mlx_lm.generate import stream_generate\n"
        "out = []\n"
        "for path, prompts in json.loads(sys.argv[1]):\n"
        "    m, t = load(path)\n"
        "    for p in prompts:\n"
        "        ids = t.apply_chat_template([{'role': 'user', 'content': p}], add_generation_prompt=True)\n"
        "        out.append([r.token for r in stream_generate(m, t, ids, max_tokens=32)])\n"
        "print(json.dumps(out))"
    )
    jobs = [[str(models[f]), [r["prompt"] for r in one_rank[f]["results"]]] for f in FAMILIES]
    reference = json.loads(_mlx("-c", script, json.dumps(jobs)).stdout.splitlines()[-1])
    ours = [r for f in FAMILIES for r in one_rank[f]["results"]]
    assert len(ours) == len(reference) == 6
    for mine, theirs in zip(ours, reference, strict=True):
        eos = 1  # mlx-lm yields the end token; the engine stops before it
        assert mine["tokens"] == [t for t in theirs if t != eos][: len(mine["tokens"])]
        assert len(mine["tokens"]) == 32 or mine["finish"] == "stop"


def _same_together(run: dict, alone: list[dict]) -> None:
    """The prompts generated together (each joining a running batch) give each prompt's one-at-a-time text."""
    assert [(r["text"], r["finish"], r["completion_tokens"]) for r in run["together"]] == [
        (r["text"], r["finish"], len(r["tokens"])) for r in alone
    ]
    assert run["batch"]["widest"] == len(alone)


@pytest.mark.parametrize("family", FAMILIES)
def test_prompts_decoded_together_give_the_one_at_a_time_text(one_rank: dict[str, dict], family: str) -> None:
    _same_together(one_rank[family], one_rank[family]["results"])


def test_gemma_decoded_together_gives_the_one_at_a_time_text(converted_gemma: Path) -> None:
    """The real Gemma 3 270M, computing in float32 as the runner does on CPUs: the prompts together (each joining
    the running batch) give each prompt's one-at-a-time text."""
    (report,) = _checks([{"model": str(converted_gemma), "mode": "single", "dtype": "float32"}], 1, max_tokens=16)
    run = report["runs"][0]
    assert all(r["text"] for r in run["results"])
    _same_together(run, run["results"])


def test_two_ranks_by_pipeline_and_tensor_match_one(models: dict[str, Path], one_rank: dict[str, dict]) -> None:
    """Both families, one launch: even and uneven pipelines and tensor sharding generate what one process does
    (the last prompt outgrows the gemma3 window); weights split; a placement whose ranges leave a gap fails."""
    shapes = [("pipeline", None), ("pipeline", [[0, 1], [1, 4]]), ("tensor", None)]
    runs = [{"model": str(models[f]), "mode": mode, "layers": layers} for f in FAMILIES for mode, layers in shapes]
    runs.append({"model": str(models["gemma3"]), "mode": "pipeline", "layers": [[0, 2], [3, 4]], "expect_error": True})
    head, follower = _checks(runs, 2)
    assert head["rank"] == 0 and follower["rank"] == 1
    for i, (family, (mode, layers)) in enumerate((f, s) for f in FAMILIES for s in shapes):
        mine, theirs, single = head["runs"][i], follower["runs"][i], one_rank[family]
        assert [r["tokens"] for r in mine["results"]] == [r["tokens"] for r in single["results"]], (family, mode)
        assert [r["text"] for r in mine["results"]] == [r["text"] for r in single["results"]]
        _same_together(mine, single["results"])  # batched across the ring too
        health = mine["health"]
        assert (health["ranks"], health["sharding"]) == (2, mode)
        assert health["layers"] == (layers[0] if layers else [0, 2] if mode == "pipeline" else None)
        held = [mine["weight_bytes"], theirs["weight_bytes"]]
        assert max(held) < single["weight_bytes"]
        if mode == "pipeline":  # every weight on exactly one rank
            assert sum(held) == single["weight_bytes"] and mine["sharded"] == theirs["sharded"] == "Linear"
        else:
            assert mine["sharded"] == theirs["sharded"] == "AllToShardedLinear"
    assert single["sharded"] == "Linear"
    errors = [head["runs"][-1]["error"], follower["runs"][-1]["error"]]
    assert errors[0] == errors[1] and "do not tile 4 layers" in errors[0]


def _ready_port(proc: subprocess.Popen, deadline: float) -> int:
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("MESHGATE_RUNNER_READY"):
            return int(line.split("port=")[1])
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"runner not ready (rc={proc.poll()})")


def _generate(port: int, text: str) -> list[dict]:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "parts": [{"type": "text", "text": text}]}],
        "sampling": {"temperature": 0.0},
        "max_tokens": 32,
    }
    with httpx.Client(timeout=60) as client:
        assert client.get(f"http://127.0.0.1:{port}/health").json()["status"] == "ok"
        reply = client.post(f"http://127.0.0.1:{port}/generate", json=body)
    return [json.loads(line) for line in reply.text.splitlines() if line]


@pytest.mark.parametrize("n", [1, 2])
def test_runner_streams_the_same_events_on_one_and_two_ranks(tiny: Path, one_rank: dict, n: int) -> None:
    from meshgate.backends.mlx.launch import launch

    argv = [str(mlx_python()), "-m", "meshgate.backends.mlx.runner", "--model", str(tiny), "--sharding", "tensor"]
    ranks = launch(
        n, argv, env=ENV, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        port = _ready_port(ranks.procs[0], time.monotonic() + 90)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).json()["ranks"] == n
        for expected in one_rank["llama"]["results"][:2]:
            events = _generate(port, expected["prompt"])
            kinds = [e["type"] for e in events]
            assert kinds[0] == "usage" and kinds[-2:] == ["usage", "finished"] and set(kinds[1:-2]) == {"text"}
            assert "".join(e["text"] for e in events if e["type"] == "text") == expected["text"]
            assert events[-2]["completion_tokens"] == len(expected["tokens"])
    finally:
        ranks.close()


def test_response_formats_hold_batched_rows_to_their_schemas(tiny: Path) -> None:
    """Greedy and sampled rows under a schema (integer bounds, enum, nullable, a recursive $ref) decode in one
    batch beside a free-text row; each answer validates; a keyword no engine enforces is a 400 naming it."""
    import jsonschema

    from meshgate.protocols.schema_rules import enforceable

    schema = {"kind": "json_schema"}
    cases = [
        {"format": schema | {"schema": PICK}},
        {"format": schema | {"schema": PICK}, "temperature": 1.0, "seed": 7},
        {"format": schema | {"schema": PICK}, "temperature": 1.0, "seed": 8},
        {"format": schema | {"schema": LIST}},
        {"max_tokens": 16},
        {"format": schema | {"schema": {"type": "array", "uniqueItems": True}}},
    ]
    done = _mlx(str(HERE / "structured_check.py"), str(tiny), json.dumps(cases))
    report = json.loads(done.stdout.splitlines()[-1])
    *answers, free, refused = report["results"]
    for case, answer in zip(cases, answers, strict=False):
        assert answer["finish"] == "stop", answer
        held = enforceable(case["format"]["schema"], steps=False)  # nullable: OpenAPI's; jsonschema's float steps
        jsonschema.validate(json.loads(answer["text"]), held)
    assert isinstance(json.loads(answers[3]["text"])["next"], dict)  # through the $ref
    assert "note" in answers[0]["text"] and ", " in answers[0]["text"]  # written as the other runners write it
    assert free["finish"] == "length" and free["text"]
    assert report["widest"] == 5
    assert refused["param"] == "response_format" and "'uniqueItems'" in refused["error"]


def test_a_resumed_stream_goes_on_as_the_undisturbed_one(tiny: Path) -> None:
    """A stream moved here after 1, 2, half and all but one of its text deltas (``Request.resume``, the ids those
    deltas carried; the cuts of a case decode side by side in one batch): greedy, the new run's deltas equal the
    undisturbed run's, byte for byte, under a schema too; sampled, the deltas up to the cut are the ones sent
    (the ids are forced, not drawn again) and what follows is a fresh draw the schema accepts."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}, "s": {"type": "string", "maxLength": 8}},
        "required": ["n", "s"],
        "additionalProperties": False,
    }
    fmt = {"kind": "json_schema", "schema": schema}
    cases = [
        {"prompt": "Tell me a story", "max_tokens": 24},
        {"prompt": "Answer in JSON", "max_tokens": 60, "format": fmt},
        {"prompt": "Answer in JSON", "max_tokens": 60, "format": fmt, "temperature": 1.0, "seed": 5},
    ]
    done = _mlx(str(HERE / "resume_check.py"), str(tiny), json.dumps(cases))
    greedy_text, greedy_json, sampled = json.loads(done.stdout.splitlines()[-1])
    for case in (greedy_text, greedy_json, sampled):
        assert len(case["resumed"]) == 4 and all(ids for _, ids in case["whole"]), case  # every delta has its ids
    for case in (greedy_text, greedy_json):
        for cut, run in case["resumed"].items():
            assert run["events"] == case["whole"] and run["finish"] == case["finish"], (cut, run)
    draws = set()
    for cut, run in sampled["resumed"].items():
        assert run["events"][: int(cut)] == sampled["whole"][: int(cut)], cut
        answer = json.loads("".join(text for text, _ in run["events"]))
        assert run["finish"] == "stop" and set(answer) == {"n", "s"} and 1 <= answer["n"] <= 9, answer
        draws.add("".join(text for text, _ in run["events"]))
    assert len(draws) > 1  # the continuations are drawn afresh, not the undisturbed draw replayed
