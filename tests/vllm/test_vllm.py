"""vLLM behind a real ``meshgate serve``: the three official SDKs, runtime files, a worker killed mid-generation;
and the real Gemma 3 270M whose greedy tokens under TP=2 and PP=2 equal TP=1.

One gateway with one vLLM instance of the tiny deterministic llama of ``tests/vllm/tiny_model.py`` (float32, built by
the test, listed through ``MESHGATE_MODELS``; TP=2 over the mp executor, eager: the fastest start) is shared by the
protocol and fault tests. The Gemma check starts the converted checkpoint (``converted_gemma``) once per mode through
``VllmBackend.launch`` as an agent does. The vLLM venv (``.cache/venvs/vllm``) is made by the first run, like the MLX
one. Every process is bounded and killed on the way out; the fault test kills a worker, so it runs last.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.cluster.faults import alive, resumes
from tests.conftest import Server
from tests.structured_schemas import LIST, PICK

HERE = Path(__file__).resolve().parent
MODEL = "tiny-vllm"
PROMPT = "Hello world"
LONG = "Ranks talk over a ring"
TOKENS = 16
VLLM_TMP = re.compile(r"^([0-9a-f]{8}-[0-9a-f]{4}-|vllm|torchinductor|ray|tmp.*vllm)")


def vllm_python() -> Path:
    from tests.compat.venvs import vllm_venv

    return vllm_venv()


def _tree(root: int) -> list[int]:
    """``root`` and all its descendants."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*/children") if Path(f"/proc/{pid}").exists() else ():
            todo += [int(c) for c in task.read_text().split()]
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _snapshot() -> dict[str, set[str]]:
    home = Path.home()
    return {
        "tmp": {p.name for p in Path("/tmp").iterdir() if VLLM_TMP.match(p.name)},
        "shm": {p.name for p in Path("/dev/shm").iterdir()},
        "cache": {p.name for p in (home / ".cache").glob("*")} | {p.name for p in (home / ".config").glob("*")},
    }


@pytest.fixture(scope="module")
def python() -> Path:
    return vllm_python()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, python: Path) -> Path:
    root = tmp_path_factory.mktemp("vllm-checkpoints")
    subprocess.run(
        [str(python), str(HERE / "tiny_model.py"), str(root / MODEL)], check=True, timeout=120, capture_output=True
    )
    return root


@pytest.fixture(scope="module")
def before() -> dict[str, set[str]]:
    return _snapshot()


@contextlib.contextmanager
def short_dir(prefix: str) -> Iterator[Path]:
    """A runtime dir under /tmp, short on purpose: vLLM's and Ray's unix socket paths under it
    (``<dir>/<instance>/tmp/<uuid>``, Ray's session sockets) must fit in 107 bytes. Removed on the way out."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def runtime_dir() -> Iterator[Path]:
    with short_dir("mg-vllm-") as path:
        yield path


@pytest.fixture(scope="module")
def server(data_dir: Path, python: Path, checkpoints: Path, runtime_dir: Path, before) -> Iterator[Server]:
    env = {
        "MESHGATE_VLLM_PYTHON": str(python),
        "MESHGATE_VLLM_TENSOR_PARALLEL": "2",
        "MESHGATE_VLLM_EAGER": "1",
        "MESHGATE_RUNTIME_DIR": str(runtime_dir),
        "MESHGATE_MODELS": f"{MODEL}={checkpoints / MODEL}",
        "MESHGATE_N_CTX": "4096",
        "MESHGATE_RESUME_WAIT": "300",  # a resumed stream waits for its instance to be placed again (~1 minute)
        "MESHGATE_MLX_PYTHON": "",
        "HF_HUB_OFFLINE": "1",
    }
    s = Server(data_dir, env=env)
    try:
        started = time.monotonic()
        warm = httpx.post(
            f"{s.url}/v1/completions",
            timeout=400,
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0},
        )
        assert warm.status_code == 200, warm.text
        print(f"vLLM TP=2 instance ready through the gateway in {time.monotonic() - started:.1f}s")
        yield s
    finally:
        s.stop()
        _assert_clean(runtime_dir, before)


def _assert_clean(runtime_dir: Path, before: dict[str, set[str]]) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (list(runtime_dir.iterdir()) or _snapshot()["shm"] - before["shm"]):
        time.sleep(0.5)
    assert list(runtime_dir.iterdir()) == [], "an instance folder outlived its instance"
    after = _snapshot()
    for where in ("tmp", "shm", "cache"):
        assert after[where] - before[where] == set(), f"vLLM left files in {where}"


def _vllm_pids(server: Server) -> list[int]:
    return [p for p in _tree(server.proc.pid)[1:] if "vllm" in _cmdline(p).lower() or "VLLM" in _cmdline(p)]


# ---------------------------------------------------------------------------------------------------- parallel


GEMMA_PROMPTS = ("The capital of France is", "def fibonacci(n):")


async def _launch_and_generate(
    python: Path, model: Path, runtime_dir: Path, mode: str, prompts: tuple[str, ...]
) -> tuple[list[str], float]:
    """Start ``model`` once in ``mode`` (``single`` TP=1, ``tensor`` TP=2) on one node through
    ``VllmBackend.launch``, as an agent does; return the greedy texts of ``prompts`` and the startup seconds."""
    from meshgate.backends.checkpoints import card_from_checkpoint, spec_from_checkpoint
    from meshgate.backends.placement import Candidate, NodeId, Shard
    from meshgate.backends.vllm import VllmBackend
    from meshgate.protocols.model import Request, Sampling, collect

    card = card_from_checkpoint(model)
    n = spec_from_checkpoint(card.name, card.path).n_layers
    a = NodeId("a")
    if mode == "tensor":
        shards = tuple(Shard(node_id=a, layer_start=0, layer_end=n, tensor_rank=r, tensor_size=2) for r in (0, 1))
    else:
        shards = (Shard(node_id=a, layer_start=0, layer_end=n),)
    plan = Candidate(
        id=f"test-{mode}",
        model=card.name,
        backend="vllm",
        strategy=mode,  # type: ignore[arg-type]
        context=512,
        shards=shards,
        memory_per_node={},
    )
    async with httpx.AsyncClient(trust_env=False) as http:
        backend = VllmBackend(http, python=str(python), runtime_dir=str(runtime_dir), eager=True, ready_timeout=400)

        async def no_peers() -> dict[str, str]:
            raise AssertionError("a single-node placement has no peers")

        started = time.monotonic()
        launched = await backend.launch(card, plan, shards[0], host="127.0.0.1", peers=no_peers)
        startup = time.monotonic() - started
        try:
            runner = backend.connect(card, plan, {"a": launched.url})
            texts = []
            for prompt in prompts:
                request = Request(
                    model=card.name, raw_prompt=prompt, sampling=Sampling(temperature=0.0), max_tokens=TOKENS
                )
                texts.append((await collect(runner.generate(request))).text)
            return texts, startup
        finally:
            await launched.stop()
            assert not launched.alive and not launched.folder.path.exists()


def test_real_gemma_greedy_tokens_under_tp2_equal_tp1(python: Path, converted_gemma: Path) -> None:
    """Gemma 3 270M (the packaged GGUF through ``meshgate convert``, bfloat16): started once per mode; TP=2 gives
    the greedy text of TP=1 (its all-reduce sums partial products in another order, the one place where a split
    can change the numbers). A pipeline computes each layer whole on one rank, so its numbers are those of one
    process by construction; its plumbing (VLLM_PP_LAYER_PARTITION, stages over Ray) is tested with the tiny
    model in test_vllm_ray, sparing a third start of Gemma (~90 s here). The two start at once (a start is mostly
    one Python thread: imports, loading, profiling), first in the module, so the shared tiny instance is not up
    yet and its idle workers do not take CPU from them."""
    modes = ("single", "tensor")

    async def both(runtime: Path) -> list[tuple[list[str], float]]:
        starts = (_launch_and_generate(python, converted_gemma, runtime, mode, GEMMA_PROMPTS) for mode in modes)
        return await asyncio.wait_for(asyncio.gather(*starts), 500)

    with short_dir("mg-vllm-") as runtime:
        results = dict(zip(modes, asyncio.run(both(runtime)), strict=True))
        for mode, (texts, startup) in results.items():
            print(f"Gemma 3 270M vLLM {mode}: ready in {startup:.1f}s, {texts}")
        reference = results["single"][0]
        assert all(len(t.strip()) > 0 for t in reference), reference
        assert results["tensor"][0] == reference
        assert list(runtime.iterdir()) == []


# ---------------------------------------------------------------------------------------------------- protocols


def test_three_sdks_get_the_same_greedy_text(server: Server) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    chat = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=TOKENS, temperature=0)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in oai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=TOKENS, temperature=0, stream=True
        )
        if c.choices
    )
    ant = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)
    message = ant.messages.create(model=MODEL, messages=messages, max_tokens=TOKENS, extra_body={"temperature": 0})
    oll = ollama.Client(host=server.url, timeout=120)
    reply = oll.chat(model=MODEL, messages=messages, options={"num_predict": TOKENS, "temperature": 0})
    text = chat.choices[0].message.content
    assert text and chat.choices[0].finish_reason == "length"
    assert chat.usage.prompt_tokens == 10 and chat.usage.completion_tokens == TOKENS
    assert streamed == text == message.content[0].text == reply.message.content
    assert message.stop_reason == "max_tokens" and message.usage.input_tokens == 10
    assert reply.eval_count == TOKENS and reply.prompt_eval_count == 10


def test_raw_prompt_stop_string_and_token_count(server: Server) -> None:
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    full = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0).choices[0].text
    stop = full[3:5]
    cut = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    ant = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)
    counted = ant.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": PROMPT}])
    assert counted.input_tokens == 10


TRIP = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 3}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


def test_structured_output_and_forced_tool_calls_validate(server: Server) -> None:
    """vLLM (llguidance) holds answers to the schemas, through each protocol's way of asking; what it would not
    enforce (a keyword, a call left to the model) is a 400 naming it, before vLLM is asked."""
    import jsonschema

    from meshgate.protocols.schema_rules import enforceable

    messages = [{"role": "user", "content": PROMPT}]
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": PICK}}
    chat = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=200, temperature=0, response_format=fmt
    )
    assert chat.choices[0].finish_reason == "stop"
    answer = chat.choices[0].message.content
    jsonschema.validate(json.loads(answer), enforceable(PICK, steps=False))  # nullable: OpenAPI's, as anyOf with null
    assert ", " in answer  # written as the llama.cpp and MLX runners write it
    oll = ollama.Client(host=server.url, timeout=120)
    linked = oll.chat(model=MODEL, messages=messages, format=LIST, options={"num_predict": 200, "temperature": 0})
    assert linked.done_reason == "stop"
    jsonschema.validate(answer := json.loads(linked.message.content), LIST)
    assert isinstance(answer["next"], dict)  # through the $ref

    tool = {"type": "function", "function": {"name": "plan_trip", "parameters": TRIP}}
    named = {"type": "function", "function": {"name": "plan_trip"}}
    call = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=100, temperature=0, tools=[tool], tool_choice=named
    )
    (called,) = call.choices[0].message.tool_calls
    assert called.function.name == "plan_trip"
    jsonschema.validate(json.loads(called.function.arguments), TRIP)
    ant = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)
    anyone = ant.messages.create(  # required ("any") with one tool: that tool, named
        model=MODEL,
        messages=messages,
        max_tokens=100,
        tools=[{"name": "plan_trip", "input_schema": TRIP}],
        tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    )
    (used,) = [b for b in anyone.content if b.type == "tool_use"]
    assert used.name == "plan_trip" and used.id.startswith("toolu_") and anyone.stop_reason == "tool_use"
    jsonschema.validate(used.input, TRIP)

    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {"uniqueItems": True}}},
        )
    assert "'uniqueItems'" in refused.value.message and refused.value.param == "response_format"
    with pytest.raises(openai.BadRequestError) as auto:
        oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, tools=[tool])
    assert auto.value.param == "tool_choice" and "required" in auto.value.message


def test_runtime_files_stay_under_the_runtime_dir(server: Server, runtime_dir: Path, before) -> None:
    folders = list(runtime_dir.iterdir())
    assert len(folders) == 1 and folders[0].name.startswith("vllm-")
    assert (folders[0] / "tmp").is_dir() and any((folders[0] / "tmp").iterdir()), "vLLM's IPC files live here"
    now = _snapshot()
    assert now["tmp"] - before["tmp"] == set() and now["cache"] - before["cache"] == set()
    env = json.loads((folders[0] / "layout.json").read_text())["env"]
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["DO_NOT_TRACK"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"].count("|") == 1  # one CPU slice per TP worker


# ---------------------------------------------------------------------------------------------------- faults


def _stream_lines(url: str, body: dict, tokens: list[int], out: list, on_text=None) -> None:
    """Read one streaming response line by line; ``tokens[0]`` counts the lines that carry generated text;
    ``on_text()`` is called at the first of them, from this thread (no polling gap)."""
    with httpx.stream("POST", url, json=body, timeout=180) as response:
        for line in response.iter_lines():
            out.append(line)
            if '"content":"' in line.replace(" ", "") or '"text_delta"' in line:
                tokens[0] += 1
                if tokens[0] == 1 and on_text is not None:
                    on_text()


def _instance(server: Server) -> dict:
    [instance] = [i for i in httpx.get(f"{server.url}/instances", timeout=10).json() if i["model"] == MODEL]
    return instance


FAULT_TOKENS = 600  # a few seconds of the tiny model; the worker is stopped at the first token, so it cannot finish


def _fault_request(server: Server) -> tuple[str, dict]:
    """A greedy streamed Anthropic message of FAULT_TOKENS. The tiny model never emits EOS (tiny_model.NO_EOS), so
    it runs to FAULT_TOKENS."""
    return f"{server.url}/v1/messages", {
        "model": MODEL,
        "stream": True,
        "messages": [{"role": "user", "content": "Ring ring ring"}],
        "max_tokens": FAULT_TOKENS,
        "temperature": 0,
    }


def test_worker_killed_mid_generation_resumes_the_stream_and_leaves_nothing(server: Server, runtime_dir: Path) -> None:
    """SIGKILL one TP worker while a greedy stream runs: vLLM's engine dies and fails the stream, the agent stops
    what is left (workers, folder, /dev/shm segments) and reports the runner failed, and the instance manager
    re-places the instance (a new epoch, a new process group). The client's stream waits through it (keep-alives)
    and goes on on the new instance from the tokens it had: its text is the undisturbed run's, byte for byte, its
    usage counts every token, and ``/metrics`` counts the resume. One stream and one kill (a kill costs a
    re-placement, over a minute)."""
    import threading

    url, body = _fault_request(server)
    reference: list[str] = []
    _stream_lines(url, body, [0], reference)
    before = _ready_instance(server)
    before_pids = _vllm_pids(server)
    workers = sorted(p for p in before_pids if "Worker" in Path(f"/proc/{p}/comm").read_text())
    assert len(workers) == 2, f"no TP workers among {[(p, _cmdline(p)) for p in before_pids]}"
    [old_folder] = list(runtime_dir.iterdir())
    before_resumes = resumes(server.url)
    tokens: list[int] = [0]
    lines: list[str] = []
    # The worker is stopped (SIGSTOP) the moment the first token reaches the client: the tiny model decodes
    # faster than a polling reader reads, so a kill timed by the reader alone can land after the last token. A
    # stopped TP worker holds up every decode step; the stream is then open with tokens sent, and the kill lands.
    reader = threading.Thread(
        target=_stream_lines,
        args=(url, body, tokens, lines, lambda: os.kill(workers[0], signal.SIGSTOP)),
        daemon=True,
    )
    reader.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and tokens[0] < 1:
        time.sleep(0.01)
    time.sleep(1.0)  # what was decoded before the stop reaches the client
    assert tokens[0] >= 1 and reader.is_alive(), lines[-5:]
    os.kill(workers[0], signal.SIGKILL)
    killed, at_kill = time.monotonic(), tokens[0]
    reader.join(400)
    assert not reader.is_alive(), lines[-3:]
    print(f"the stream ended {time.monotonic() - killed:.1f}s after the kill; text lines at the kill {at_kill}")
    assert at_kill < FAULT_TOKENS // 2, at_kill  # the kill landed early in the stream
    assert _anthropic_text(lines) == _anthropic_text(reference) and len(_anthropic_text(reference)) > 100
    assert "event: error" not in "\n".join(lines)
    assert _output_tokens(lines) == _output_tokens(reference) == FAULT_TOKENS
    assert resumes(server.url) == before_resumes + 1
    # vLLM's watchdog stops the API server; the agent stops what is left and reports the runner failed; the
    # instance manager re-places the instance: no process, folder or segment of the old one remains
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (
        any(alive(p) for p in before_pids) or old_folder.exists() or _instance(server)["epoch"] == before["epoch"]
    ):
        time.sleep(0.5)
    assert not any(alive(p) for p in before_pids), [(p, _cmdline(p)) for p in before_pids if alive(p)]
    assert not old_folder.exists(), "the dead instance's runtime folder was not removed"
    replaced = _instance(server)
    assert replaced["id"] == before["id"] and replaced["epoch"] == before["epoch"] + 1, replaced
    kinds = [
        e["kind"]
        for e in httpx.get(f"{server.url}/events", params={"count": 1000}, timeout=10).json()
        if e["instance_id"] == before["id"]
    ]
    assert "instance.failed" in kinds and "instance.replaced" in kinds, kinds
    assert kinds.index("instance.failed") < kinds.index("instance.replaced")
    assert set(_vllm_pids(server)).isdisjoint(before_pids)  # the re-placed instance is a new process group


def _anthropic_text(lines: list[str]) -> str:
    deltas = (json.loads(line[6:]) for line in lines if line.startswith("data: "))
    return "".join(d["delta"].get("text", "") for d in deltas if d["type"] == "content_block_delta")


def _output_tokens(lines: list[str]) -> int:
    deltas = (json.loads(line[6:]) for line in lines if line.startswith("data: "))
    return next(d["usage"]["output_tokens"] for d in deltas if d["type"] == "message_delta")


def _ready_instance(server: Server, timeout: float = 400) -> dict:
    """The tiny model's instance once ready (a re-placement, if one is under way, must finish first)."""
    deadline = time.monotonic() + timeout
    while (found := _instance(server))["state"]["state"] != "ready":
        assert found["state"]["state"] != "failed" and time.monotonic() < deadline, found
        time.sleep(0.5)
    return found
