"""Moved: the user-model registry is neutral now, ``meshgate.backends.registry`` (no model format, no backend).

This name re-exports it for code that still imports it from here; new code imports ``meshgate.backends.registry``.
"""

from __future__ import annotations

from meshgate.backends.registry import (
    MAX_REGISTRY_BYTES,
    MAX_USER_MODELS,
    HidingSource,
    ModelRegistry,
    RegistryFull,
    RegistrySource,
    UserModel,
    sha256_file,
)

__all__ = [
    "MAX_REGISTRY_BYTES",
    "MAX_USER_MODELS",
    "HidingSource",
    "ModelRegistry",
    "RegistryFull",
    "RegistrySource",
    "UserModel",
    "sha256_file",
]
