"""Real agent CLIs for the end-to-end tests: Claude Code and OpenAI's Codex CLI, installed with npm and run once.

``install()`` puts both packages (pinned versions) under ``.cache/agent-clients`` in the repository (ignored by
git) with ``npm install --prefix``, once; later runs reuse them. Each run gets its own ``HOME`` (and
``CODEX_HOME``) in a temporary folder, a fake API key, and every update check, telemetry and error report turned
off, so nothing leaves the machine but requests to the gateway.

``request_lines`` reads the gateway's request log (one ``meshgate.requests`` line per request, logfmt; see
``meshgate.gateway.telemetry.middleware``) back into dicts, so tests can check which endpoints a client called.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.conftest import ROOT

CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.197"
CODEX = "@openai/codex@0.171.0"
PACKAGES = (CLAUDE_CODE, CODEX)
PREFIX = ROOT / ".cache" / "agent-clients"

QUIET = {
    # Claude Code: no auto-update, telemetry, error reports or other traffic besides the API calls
    "DISABLE_AUTOUPDATER": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_BUG_COMMAND": "1",
    "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
    "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1",
    "ANTHROPIC_API_KEY": "sk-ant-meshgate-test",
    # Codex
    "OPENAI_API_KEY": "sk-meshgate-test",
    "CODEX_DISABLE_UPDATE_CHECK": "1",
    "NO_COLOR": "1",
}


def _versions_installed() -> bool:
    for spec in PACKAGES:
        name, version = spec.rsplit("@", 1)
        manifest = PREFIX / "node_modules" / name / "package.json"
        if not manifest.is_file() or json.loads(manifest.read_text()).get("version") != version:
            return False
    return all((PREFIX / "node_modules" / ".bin" / tool).exists() for tool in ("claude", "codex"))


def install() -> Path:
    """The ``node_modules/.bin`` folder holding ``claude`` and ``codex``, installed on first use."""
    if not _versions_installed():
        npm = shutil.which("npm")
        if npm is None:
            raise RuntimeError("npm is needed to install the agent CLIs (Node.js 20 or later)")
        PREFIX.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                npm,
                "install",
                "--prefix",
                str(PREFIX),
                "--no-audit",
                "--no-fund",
                "--loglevel=error",
                CLAUDE_CODE,
                CODEX,
            ],
            check=True,
            timeout=600,
            env={**os.environ, "DISABLE_AUTOUPDATER": "1"},
        )
    return PREFIX / "node_modules" / ".bin"


@dataclass
class Run:
    """One finished CLI run: its exit status, output and how long it took."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def json(self) -> dict[str, Any]:
        """Claude Code's ``--output-format json`` result (the last JSON line of stdout)."""
        lines = [line for line in self.stdout.splitlines() if line.startswith("{")]
        if not lines:
            raise AssertionError(f"no JSON result (exit {self.returncode}):\n{self.stdout}\n{self.stderr}")
        return json.loads(lines[-1])


def _run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> Run:
    import time

    started = time.monotonic()
    done = subprocess.run(
        argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    return Run(done.returncode, done.stdout, done.stderr, time.monotonic() - started)


def _base_env(home: Path) -> dict[str, str]:
    home.mkdir(parents=True, exist_ok=True)
    keep = {k: os.environ[k] for k in ("PATH", "LANG", "TMPDIR") if k in os.environ}
    return {**keep, **QUIET, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config")}


def claude(
    bin_dir: Path, gateway: str, home: Path, *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> Run:
    """``claude -p ... --output-format json`` against ``gateway``'s Anthropic API, in ``home``/work; ``env`` adds
    settings (``CLAUDE_CODE_MAX_OUTPUT_TOKENS``, ...)."""
    env = {**_base_env(home), "ANTHROPIC_BASE_URL": gateway, **(env or {})}
    work = home / "work"
    work.mkdir(exist_ok=True)
    argv = [str(bin_dir / "claude"), "-p", *args, "--output-format", "json", "--no-session-persistence"]
    return _run(argv, env, work, timeout)


CODEX_CONFIG = """\
model = "{model}"
model_provider = "meshgate"
model_instructions_file = "{instructions}"
model_context_window = {context}
check_for_update_on_startup = false
include_permissions_instructions = false
include_environment_context = false
web_search = "disabled"

[model_providers.meshgate]
name = "meshgate"
base_url = "{gateway}/v1"
wire_api = "responses"
env_key = "OPENAI_API_KEY"
request_max_retries = 0
stream_max_retries = 0

[analytics]
enabled = false

[feedback]
enabled = false
"""


def codex(
    bin_dir: Path,
    gateway: str,
    home: Path,
    model: str,
    prompt: str,
    *args: str,
    context: int,
    timeout: float = 300,
) -> Run:
    """``codex exec [args] prompt`` against ``gateway``'s Responses API through a custom provider in a fresh
    ``CODEX_HOME``; the long built-in instructions are replaced by one line (its tools stay)."""
    env = _base_env(home)
    codex_home = home / ".codex"
    codex_home.mkdir(exist_ok=True)
    instructions = codex_home / "instructions.md"
    instructions.write_text("You are a helpful assistant. Answer in one short sentence.\n")
    config = CODEX_CONFIG.format(model=model, instructions=instructions, context=context, gateway=gateway)
    (codex_home / "config.toml").write_text(config)
    env["CODEX_HOME"] = str(codex_home)
    work = home / "work"
    work.mkdir(exist_ok=True)
    argv = [
        str(bin_dir / "codex"),
        "exec",
        "--skip-git-repo-check",
        "--ephemeral",
        "--sandbox",
        "read-only",
        "--color",
        "never",
        *args,
        prompt,
    ]
    return _run(argv, env, work, timeout)


_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S*)')


def request_lines(log: str) -> list[dict[str, Any]]:
    """The gateway's ``meshgate.requests`` lines in ``log`` (``request id=... status=200 ...``) as dicts; numbers
    as ints, ``-`` as ``None``, quoted values unescaped; ``error`` is ``None`` when the line has none."""
    out = []
    for line in log.splitlines():
        at = line.find("meshgate.requests")
        start = line.find(" request id=", at if at >= 0 else 0)
        if start < 0:
            continue
        fields: dict[str, Any] = {}
        for key, raw in _FIELD.findall(line[start + len(" request ") :]):
            value: Any = json.loads(raw) if raw.startswith('"') else raw
            if value == "-":
                value = None
            elif isinstance(value, str) and value.isdigit():
                value = int(value)
            fields[key] = value
        fields.setdefault("error", None)
        out.append(fields)
    return out
