"""Real agent clients end to end: Claude Code and OpenAI's Codex CLI, installed with npm, each running one
non-interactive turn against a real gateway serving the packaged Gemma 3 270M; plus what long agent prompts need
of the runner (a client that goes away mid-prefill frees it at once).

The CLIs come from npm on first use (``agent_clients.install``, cached under ``.cache/agent-clients``); each run
has its own ``HOME``, a fake key and no traffic but to the gateway. Which endpoints a client called, with what
status, prompt tokens and TTFT, is read from the gateway's request log (``meshgate.requests`` lines) and printed.

Claude Code's own system prompt and tool definitions are about 18,700 tokens. At the default context (4,096) the
gateway refuses that with Anthropic's ``prompt is too long`` 400, which Claude Code reports as its result; at
32,768 it fits, but its first prefill takes about 4 minutes on 2 cores, too long for the suite (docs/operations.md
has the figures), so the success test keeps Claude Code's own system prompt with one of its tools (``--tools
Read``, about 2,000 tokens). Its turn loop on the packaged model runs with ``--bare``, a short ``--system-prompt``
and one tool (``Read``), about 450 tokens. Codex runs with its instructions replaced by one line
(``model_instructions_file``) and its function tools kept, about 2,200 tokens. The packaged model is a base model
that never ends a turn by itself: on it Claude Code's answers stop at ``max_tokens``
(``CLAUDE_CODE_MAX_OUTPUT_TOKENS=8``) and Codex's answer is held to a JSON schema (``--output-schema``), whose
grammar ends it. A model created from it with a stored ``stop`` (Ollama's Modelfile ``PARAMETER stop``, through
``/api/create``) ends its turns: on it Claude Code, with its own system prompt, and a plain ``codex exec`` report
success.

Slow (long): every test starts a gateway and the model.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from meshgate.gateway.telemetry.middleware import REPORT_DELAY
from tests.conftest import MODEL, Server
from tests.e2e import agent_clients
from tests.e2e.agent_clients import request_lines

pytestmark = pytest.mark.runtime  # long: gateways, the model and two npm-installed CLIs (about 2 minutes)

SECRET = {"MESHGATE_CLUSTER_SECRET": "agent-clients-test-secret"}  # lets the test read the runner's /health
BRIEF = "gemma3-brief"  # created from MODEL with a stored stop, as tests/e2e/test_model_defaults.py creates it
GREEDY = "gemma3-greedy"  # created from MODEL with temperature 0 stored, for a client that sends none


@pytest.fixture(scope="module")
def bin_dir() -> Path:
    return agent_clients.install()


def _gateway(data_dir: Path, n_ctx: int) -> Server:
    """A gateway logging its requests, with the model placed (a cold model answers a stream's errors inside it)."""
    server = Server(data_dir, "--n-ctx", str(n_ctx), "--log-level", "info", env={"MESHGATE_PARALLEL": "2", **SECRET})
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).raise_for_status()
    deadline = time.monotonic() + 10
    while not _requests(server):  # its log line comes once the response is sent: wait, so tests start after it
        assert time.monotonic() < deadline, "no request log line"
        time.sleep(0.05)
    return server


@pytest.fixture(scope="module")
def small(data_dir: Path) -> Iterator[Server]:
    """The default context, 4,096 tokens."""
    server = _gateway(data_dir, 4096)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def roomy(data_dir: Path) -> Iterator[Server]:
    """A context of 16,384 tokens, for the agents' turns and the long-prefill test."""
    server = _gateway(data_dir, 16384)
    yield server
    server.stop()


def _create_brief(server: Server) -> None:
    """``BRIEF``: the packaged model with ``stop: ["\\n"]`` stored (Ollama's ``PARAMETER stop``), made through
    ``/api/create``. The packaged model is a base model: its ``<end_of_turn>`` is untrained, so it never ends a turn
    by itself; with the stored stop its one-line answer ends the turn (``end_turn``). Temperature 0 is stored too: a
    sampled answer could run to ``num_predict`` before its first newline (Codex then exits 1, as CI once saw)."""
    body = {
        "model": BRIEF,
        "from": MODEL,
        "parameters": {"stop": ["\n"], "num_predict": 24, "temperature": 0},  # greedy: one answer, every run
        "system": "Answer in one short line.",
        "stream": False,
    }
    created = httpx.post(f"{server.url}/api/create", json=body, timeout=120)
    assert created.status_code == 200 and created.json()["status"] == "success", created.text


def _requests(server: Server, since: int = 0) -> list[dict]:
    """The request log lines of model API calls the gateway wrote after ``since`` of them."""
    time.sleep(REPORT_DELAY + 0.2)  # the gateway writes its request lines in batches (its requests have ended)
    httpx.get(f"{server.url}/metrics", timeout=30).raise_for_status()  # a scrape writes what is pending, now
    lines = request_lines(server.log.read_text(errors="replace"))
    return [r for r in lines if r["path"].startswith("/v1/")][since:]


def _api_calls(lines: list[dict]) -> list[tuple[str, str, int]]:
    """(method, path, status) of the model API calls (not the test's own ``/instances`` look-ups)."""
    return [(r["method"], r["path"], r["status"]) for r in lines if r["path"].startswith("/v1/")]


def _report(label: str, lines: list[dict]) -> None:
    for r in lines:
        print(
            f"{label}: {r['method']} {r['path']} status={r['status']} prompt_tokens={r['prompt_tokens']} "
            f"ttft_ms={r['ttft_ms']} duration_ms={r['duration_ms']}"
        )


# ---------------------------------------------------------------------------------------------------- Claude Code


def test_claude_code_default_prompt_is_too_long_for_4096(bin_dir, small, tmp_path):
    """Claude Code's full prompt (~18.7k tokens) gets Anthropic's 400, and Claude Code reports it as an error."""
    before = len(_requests(small))
    run = agent_clients.claude(bin_dir, small.url, tmp_path / "home", "Say hello", "--model", MODEL, timeout=180)
    result = run.json()
    lines = _requests(small, before)
    _report("claude default@4096", lines)
    assert result["is_error"] is True and result["terminal_reason"] == "prompt_too_long", result
    assert "limit 4095" in result["result"], result  # Claude Code read the numbers out of the message
    messages = [r for r in lines if r["path"] == "/v1/messages"]
    assert messages and all(r["status"] == 400 for r in messages), _api_calls(lines)
    assert "prompt is too long" in messages[0]["error"] and "> 4095 maximum" in messages[0]["error"]
    told = int(messages[0]["error"].split("prompt is too long: ")[1].split()[0])
    assert 15_000 < told < 40_000  # the whole system prompt and tool set was counted


def test_claude_code_runs_its_turn_loop_on_the_model(bin_dir, roomy, tmp_path):
    """``--bare`` with a short system prompt and one tool (``Read``): Claude Code streams the model's answer. The
    packaged base model never ends a turn by itself at temperature 0 (its ``<end_of_turn>`` is untrained), so every
    answer stops at ``max_tokens``; Claude Code asks it to go on three times (each request a prefix of the next,
    taken from the slot's cache) and then reports the output limit as its result. Claude Code sends no
    ``temperature`` (Anthropic's default is 1: sampled, with a fresh seed), so the model is ``GREEDY``: the packaged
    one with ``temperature 0`` stored, which a request that sets none gets (once in a full run a sampled first
    answer drew an end of turn within 8 tokens)."""
    body = {"model": GREEDY, "from": MODEL, "parameters": {"temperature": 0}, "stream": False}
    created = httpx.post(f"{roomy.url}/api/create", json=body, timeout=120)
    assert created.status_code == 200 and created.json()["status"] == "success", created.text
    before = len(_requests(roomy))  # GREEDY has no instance yet: its first one is placed for this run
    run = agent_clients.claude(
        bin_dir,
        roomy.url,
        tmp_path / "home",
        "Say hello",
        "--model",
        GREEDY,
        "--bare",
        "--system-prompt",
        "You are a helpful assistant. Answer in one short sentence.",
        "--tools",
        "Read",
        "--max-turns",
        "1",
        timeout=400,
        env={"CLAUDE_CODE_MAX_OUTPUT_TOKENS": "8"},
    )
    result = run.json()
    lines = _requests(roomy, before)
    _report("claude bare", lines)
    print(f"claude bare: {run.seconds:.1f} s, result {result.get('result')!r}")
    calls = _api_calls(lines)
    assert calls and all(c == ("POST", "/v1/messages", 200) for c in calls), calls
    assert len(calls) == 4, calls  # the turn and Claude Code's three "go on" requests
    assert all(r["generated_tokens"] == 8 and r["error"] is None for r in lines), lines
    prompts = [r["prompt_tokens"] for r in lines]
    assert prompts == sorted(prompts) and prompts[0] > 300, prompts  # system prompt, Read's schema, the question
    health = _health(roomy, GREEDY)  # later requests took the earlier ones from a slot or the KV tier
    assert health["reused_tokens"] + health.get("restored_tokens", 0) >= sum(prompts[:-1]) - 3
    assert result["terminal_reason"] == "completed" and result["num_turns"] == 1, result
    assert "exceeded the 8 output token maximum" in result["result"], result  # it read stop_reason max_tokens
    usage = result["usage"]  # Anthropic's input_tokens leave out what was read from the cache (ANT usage)
    assert usage["output_tokens"] == 32 and usage["cache_read_input_tokens"] > 0, result
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == sum(prompts), result


def test_claude_code_completes_a_turn_with_its_default_system_prompt(bin_dir, roomy, tmp_path):
    """``claude -p "Say hello" --model gemma3-brief --tools Read``: Claude Code's own default system prompt (not
    ``--bare``, no ``--system-prompt``) with one of its tools, about 2,000 tokens. The stored stop ends the one-line
    answer, so Claude Code's single request is its whole turn and it reports success with the answer as its
    result. Its whole tool set (~18.7k tokens) is counted by the 4,096 test above; served at 32,768 it succeeds
    the same way, after a first prefill of about 4 minutes on 2 cores (docs/operations.md: too long for the suite)."""
    _create_brief(roomy)
    before = len(_requests(roomy))
    run = agent_clients.claude(bin_dir, roomy.url, tmp_path / "home", "Say hello", "--model", BRIEF, "--tools", "Read")
    result = run.json()
    lines = _requests(roomy, before)
    _report("claude default system prompt@16384", lines)
    print(f"claude default system prompt@16384: {run.seconds:.1f} s, result {result.get('result')!r}")
    calls = _api_calls(lines)
    assert calls == [("POST", "/v1/messages", 200)], calls  # one request: the turn ended by itself
    assert lines[0]["error"] is None and lines[0]["prompt_tokens"] > 1_500, lines  # its own system prompt, not --bare
    assert result["is_error"] is False and result["subtype"] == "success", result
    assert result["stop_reason"] == "end_turn" and result["num_turns"] == 1, result
    assert result["result"].strip() and "\n" not in result["result"].strip(), result
    assert result["usage"]["input_tokens"] == lines[0]["prompt_tokens"], result
    assert result["usage"]["output_tokens"] == lines[0]["generated_tokens"], result


# ---------------------------------------------------------------------------------------------------- Codex CLI


def test_codex_exec_completes_a_turn(bin_dir, roomy, tmp_path):
    """``codex exec`` through a custom provider on ``/v1/responses`` (streamed, with its function tools). Its
    ``--output-schema`` becomes ``text.format``, whose grammar ends the base model's answer; Codex exits 0 and
    prints it as the final message."""
    schema = tmp_path / "schema.json"
    schema.write_text(
        json.dumps(
            {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"],
                "additionalProperties": False,
            }
        )
    )
    before = len(_requests(roomy))
    run = agent_clients.codex(
        bin_dir, roomy.url, tmp_path / "home", MODEL, "Say hello", "--output-schema", str(schema), context=16384
    )
    lines = _requests(roomy, before)
    _report("codex", lines)
    print(f"codex: {run.seconds:.1f} s, final message {run.stdout.strip()!r}")
    assert run.returncode == 0, (run.stdout, run.stderr)
    final = json.loads(run.stdout.strip().splitlines()[0])  # the final message goes to stdout
    assert isinstance(final["ok"], bool)
    calls = _api_calls(lines)
    assert calls == [("POST", "/v1/responses", 200)], calls
    assert lines[0]["error"] is None and lines[0]["generated_tokens"] >= 5
    assert lines[0]["prompt_tokens"] > 1000  # its function tools were offered to the model


def test_codex_exec_completes_a_plain_turn_on_a_model_with_a_stored_stop(bin_dir, roomy, tmp_path):
    """``codex exec "Say hello"`` with nothing but the model changed (``gemma3-brief``): its one-line answer ends
    the turn, Codex exits 0 and prints it as the final message."""
    _create_brief(roomy)
    before = len(_requests(roomy))
    run = agent_clients.codex(bin_dir, roomy.url, tmp_path / "home", BRIEF, "Say hello", context=16384)
    lines = _requests(roomy, before)
    _report("codex brief", lines)
    print(f"codex brief: {run.seconds:.1f} s, final message {run.stdout.strip()!r}")
    assert run.returncode == 0, (run.stdout, run.stderr)
    assert run.stdout.strip() and "\n" not in run.stdout.strip(), run.stdout
    calls = _api_calls(lines)
    assert calls == [("POST", "/v1/responses", 200)], calls
    assert lines[0]["error"] is None and lines[0]["prompt_tokens"] > 1000 and lines[0]["generated_tokens"] >= 1


# ---------------------------------------------------------------------------------------------------- long prefills


def _health(server: Server, model: str = MODEL) -> dict:
    """The runner health of ``model``'s instance."""
    instances = httpx.get(f"{server.url}/instances", timeout=5).json()
    instance = next(i for i in instances if i["model"] in (model, f"{model}:latest"))
    url = next(r["url"] for r in instance["runners"].values() if r.get("url"))
    headers = {"x-meshgate-secret": SECRET["MESHGATE_CLUSTER_SECRET"]}
    return httpx.get(f"{url}/health", headers=headers, timeout=5).json()


def _body(content: str) -> dict:
    messages = [{"role": "user", "content": content}]
    return {"model": MODEL, "stream": True, "max_tokens": 1, "temperature": 0, "messages": messages}


def _ttft(server: Server, content: str) -> float:
    """Seconds to the first streamed token of a chat request."""
    began = time.monotonic()
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=_body(content), timeout=600) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                return time.monotonic() - began
    raise AssertionError("the stream ended without a token")


def _stream_then_leave(server: Server, content: str, seconds: float) -> None:
    """Start a streamed chat request and disconnect once no byte came for ``seconds`` (it is prefilling)."""
    timeout = httpx.Timeout(600, read=seconds)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=_body(content), timeout=timeout) as response:
        assert response.status_code == 200
        try:
            for _ in response.iter_bytes():
                pass
        except httpx.ReadTimeout:
            return
    raise AssertionError("the long prompt was answered before the client left")


def test_a_disconnect_during_a_long_prefill_stops_it(roomy):
    """An ~8k-token prompt, streamed and left after a second: the runner drops it within a prefill chunk, so the
    next short request starts at once instead of after the long prefill."""
    short_alone = _ttft(roomy, "Say hi.")
    per_1k = _ttft(roomy, _prose(1000))  # prefill speed: an 8k prompt takes at least 8 times this
    long_prefill = 8 * per_1k
    _stream_then_leave(roomy, _prose(8000), 1.0)
    left = time.monotonic()
    while _health(roomy)["active_sequences"]:
        assert time.monotonic() - left < long_prefill / 4, "the runner kept prefilling for a client that left"
        time.sleep(0.05)
    freed = time.monotonic() - left
    ttft = _ttft(roomy, "Say hi again.")
    print(
        f"prefill: short alone {short_alone:.2f} s, 1k tokens {per_1k:.2f} s (8k >= {long_prefill:.1f} s); "
        f"slot freed {freed:.2f} s after the disconnect; next short request's TTFT {ttft:.2f} s"
    )
    assert ttft < short_alone + long_prefill / 4
    left_line = max(_requests(roomy), key=lambda r: r["prompt_tokens"] or 0)  # the request that was left
    assert left_line["prompt_tokens"] > 7000 and left_line["generated_tokens"] == 0, left_line
    assert "went away" in left_line["error"], left_line  # logged as cut short, with why


def _prose(tokens: int) -> str:
    """About ``tokens`` tokens of varied text that starts with a fresh nonce (so no slot holds its prefix)."""
    words = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar".split()
    text = " ".join(f"{words[i % 15]}{i % 97}" for i in range(tokens // 3))
    return f"{secrets.token_hex(8)} {text}"
