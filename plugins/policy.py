"""The built-in backend choice: the first backend, in preference order, that supports the model.

Several backends may serve one format (vLLM and MLX both serve safetensors checkpoints), so the order is explicit:
``by_preference`` puts the backends named in ``Settings.backend_preference`` (``MESHGATE_BACKEND_PREFERENCE``,
default ``vllm,mlx``) first, in that order, then the rest in registration order; the control plane hands that list
to ``meshgate_choose_backend``. A backend is registered only where its runtime is present, so the default prefers
vLLM where it is installed and MLX otherwise. Published as the ``default_policy`` entry point; it runs last, so any
other plugin's choice wins.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from meshgate.backends.base import Backend, ModelCard
from meshgate.plugins.hookspecs import hookimpl


def by_preference(backends: Iterable[Backend], preference: Sequence[str]) -> list[Backend]:
    """``backends`` with those named in ``preference`` first, in that order; the others keep their order.

    Example::

        by_preference([llama_cpp, mlx, vllm], ("vllm", "mlx"))  # -> [vllm, mlx, llama_cpp]
    """
    rank = {name: i for i, name in enumerate(preference)}
    return sorted(backends, key=lambda b: rank.get(b.name, len(rank)))  # sorted() is stable


@hookimpl(trylast=True)
def meshgate_choose_backend(card: ModelCard, backends: Sequence[Backend]) -> Backend | None:
    return next((b for b in backends if b.supports(card)), None)
