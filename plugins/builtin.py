"""The built-in llama.cpp plugin: the llama.cpp backend, the packaged and configured GGUF sources, the user models
(Ollama ``/api/copy``, ``/api/create``) that are GGUF files, and the ``meshgate convert`` command (a GGUF as a
Hugging Face checkpoint, for MLX and vLLM).

Its own settings (``LlamaCppSettings``) are read here, not by the core ``Settings``. The registry of user models and
the Hugging Face checkpoints are the neutral ``models`` plugin's (``plugins.models``), so disabling this one
(``MESHGATE_DISABLED_PLUGINS=llama_cpp``) leaves MLX and vLLM models listed.

Published as the ``llama_cpp`` entry point in meshgate's own ``pyproject.toml``.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import httpx
import msgspec

from meshgate.backends.base import Backend, ModelCard, ModelSource
from meshgate.backends.llama_cpp import LlamaCppBackend
from meshgate.backends.llama_cpp.sources import GGUFPathSource, PackagedGGUFSource, card_from_gguf
from meshgate.backends.registry import HidingSource, ModelRegistry, RegistrySource
from meshgate.plugins.hookspecs import RegisterCommand, hookimpl
from meshgate.plugins.settings import PluginSettings, Settings

__all__ = ["LlamaCppSettings", "kv_tiers"]

MIB = 1 << 20

log = logging.getLogger("meshgate.plugins.llama_cpp")


class LlamaCppSettings(PluginSettings, frozen=True):
    """The llama.cpp plugin's own settings, each from ``MESHGATE_<NAME>``.

    Attributes:
        llama_repack: Let llama.cpp repack CPU weights (faster on some CPUs; a split model then no longer gives
            exactly the tokens of a single process, so it is off by default).
        exact_batches: llama.cpp runners decode so every row of a batch is exactly the token decoded alone, and a
            request's greedy text is the same alone and under load: in one call on ggml's reference matmuls
            (``cpu_kernels``; ggml's tiled K-quant matmul sums in another order once 8 tokens share a call), in
            groups of 7 where those cannot be had (RPC workers, repacked weights; ``batch.decode_group``).
            ``MESHGATE_EXACT_BATCHES=0``: one call, the kernels as they are (about a quarter of greedy texts then
            differ under load).
        llama_calibrate: Measure this node's llama.cpp speed once (on the packaged model, a few seconds, cached
            for the machine in ``~/.cache/meshgate``) for the planner's tok/s estimates
            (``MESHGATE_LLAMA_CALIBRATE=0``: estimate from a numpy matmul instead).
        kv_ram_mib: MiB of host memory each llama.cpp runner (and each rank of an MLX runner) keeps prompts' KV in
            (the planner counts it as the runner's memory); -1: a sixteenth of its node's memory, at most 8 GiB
            (MLX runners: none, their disk tier only); 0: no host tier.
        kv_disk_mib: MiB of ``kv_dir`` the node's runners keep prompts' KV in, across restarts; -1: a tenth of the
            free space there, at most 32 GiB; 0: no disk tier.
        kv_dir: The disk tier's directory (default ``<data dir>/kv-cache``).
        llama_stream_interval_ms: Milliseconds a llama.cpp runner holds its streams' next tokens after it sent some, so
            a fast decode sends several tokens a write instead of one (each write wakes the runner's, the gateway's
            and the client's threads, which take the cores from llama.cpp's compute threads; docs/runtimes.md). A
            stream's first token and its end are never held. 0: every token goes out the step it is decoded.
    """

    llama_repack: bool = False
    exact_batches: bool = True
    llama_calibrate: bool = True
    kv_ram_mib: int = -1
    kv_disk_mib: int = -1
    kv_dir: str = ""
    llama_stream_interval_ms: Annotated[int, msgspec.Meta(ge=0)] = 50


def _gguf_card(path: str) -> ModelCard | None:
    """A user model's card when its file is a GGUF (the registry reader for this format)."""
    return card_from_gguf("", path, digest="", source="") if os.path.isfile(path) else None


@hookimpl
def meshgate_register_backends(
    register: Callable[[Backend], None], settings: Settings, http: httpx.AsyncClient
) -> None:
    own = LlamaCppSettings.from_settings(settings)
    register(
        LlamaCppBackend(
            http,
            python=settings.runner_python,
            n_ctx=settings.runner_context,
            threads=settings.threads,
            cache_dir=str(Path(settings.data_dir) / "rpc-cache"),
            repack=own.llama_repack,
            parallel=settings.parallel,
            exact=own.exact_batches,
            spares=settings.batch_spares,
            batch_aging=settings.batch_aging,
            stream_interval=own.llama_stream_interval_ms / 1000,
            calibration_model=(lambda: _packaged_path(settings)) if own.llama_calibrate else None,
            **kv_tiers(own, Path(settings.data_dir)),
        )
    )


def kv_tiers(own: LlamaCppSettings, data_dir: Path) -> dict[str, Any]:
    """The KV tiers' budgets: as set, or sized from this machine's memory and the directory's free space (the MLX
    plugin's runners take them too)."""
    directory = Path(own.kv_dir) if own.kv_dir else data_dir / "kv-cache"
    ram = own.kv_ram_mib * MIB if own.kv_ram_mib >= 0 else None  # None: sized from each node's memory
    if own.kv_disk_mib >= 0:
        disk = own.kv_disk_mib * MIB
    else:
        probe = next((p for p in (directory, *directory.parents) if p.exists()), Path("/"))
        disk = min(32 << 30, shutil.disk_usage(probe).free // 10)
    return {"kv_ram": ram, "kv_dir": str(directory), "kv_disk": disk}


def _packaged_path(settings: Settings) -> str | None:
    """The packaged GGUF's path (assembled on first use), the model a node's llama.cpp speed is measured on."""
    cards = PackagedGGUFSource(settings.models_dir).models()
    return cards[0].path if cards else None


@hookimpl
def meshgate_register_model_sources(register: Callable[[ModelSource], None], settings: Settings) -> None:
    registry = ModelRegistry.in_data_dir(settings.data_dir)  # user models (Ollama copy/create/delete)
    register(RegistrySource(registry, _gguf_card))
    register(HidingSource(PackagedGGUFSource(settings.models_dir), registry))
    if settings.models:
        register(HidingSource(GGUFPathSource(settings.model_paths(), Path(settings.data_dir)), registry))


@hookimpl
def meshgate_register_commands(register: RegisterCommand) -> None:
    p = register("convert", _convert, help="write a GGUF model as a Hugging Face checkpoint (for MLX and vLLM)")
    p.add_argument("model_name", metavar="MODEL", help="a model name from `meshgate models`, or a .gguf path")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--name", help="the name to list it under (default MODEL-bf16, -f16 or -f32)")
    p.add_argument("--out", help="the directory to write (default DATA_DIR/models/hf/NAME)")
    p.add_argument("--data-dir", help="where models and state live (default $XDG_DATA_HOME/meshgate)")


def _find(settings: Settings, name: str) -> ModelCard | None:
    """The model ``name`` names among every enabled plugin's sources, as the gateway's catalog resolves it (the
    first source to list a name wins; ``name`` and ``name:latest`` are one model)."""
    from meshgate.plugins.manager import build_plugin_manager

    sources: list[ModelSource] = []
    build_plugin_manager(settings).hook.meshgate_register_model_sources(register=sources.append, settings=settings)
    cards: dict[str, ModelCard] = {}
    for source in sources:
        try:
            for card in source.models():
                cards.setdefault(card.name, card)
        except Exception:
            log.exception("model source %r failed; its models are not listed", source.name)
    tagged = name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"
    return cards.get(name) or cards.get(tagged) or cards.get(name.removesuffix(":latest"))


def _convert(settings: Settings, args: argparse.Namespace) -> int:
    """``meshgate convert``: write a GGUF (a model name or a ``.gguf`` path) as a Hugging Face checkpoint."""
    from meshgate.backends.llama_cpp.convert import convert, default_name

    if args.data_dir:
        settings = settings.replace(data_dir=args.data_dir)
    if args.model_name.endswith(".gguf") and os.path.isfile(args.model_name):
        path, model = args.model_name, Path(args.model_name).stem
    else:
        card = _find(settings, args.model_name)
        if card is None:
            print(f"unknown model {args.model_name!r} (not in `meshgate models`, not a .gguf file)", file=sys.stderr)
            return 1
        if card.format != "gguf":
            print(f"{card.name} is {card.format}, not a GGUF", file=sys.stderr)
            return 1
        path, model = card.path, card.name
    name = args.name or default_name(model, args.dtype)
    out = Path(args.out) if args.out else settings.models_dir / "hf" / name.replace(":", "-")
    started = time.monotonic()
    convert(path, out, dtype=args.dtype, name=name, progress=lambda step: print(step, file=sys.stderr, flush=True))
    print(f"{out}\n{name}")
    print(f"converted {path} in {time.monotonic() - started:.1f}s", file=sys.stderr)
    return 0
