"""Fixtures for the llama.cpp runner's plain-function tests."""

from __future__ import annotations

import llama_cpp
import pytest

from meshgate.backends.llama_cpp.grammar import Grammars


@pytest.fixture(scope="session")
def grammars(packaged_gguf) -> Grammars:
    """One ``Grammars`` over the packaged model's vocabulary (loaded vocabulary-only), for the whole session."""
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(packaged_gguf).encode(), params)
    grammars = Grammars(llama_cpp.llama_model_get_vocab(model))
    grammars.model = model  # type: ignore[attr-defined]  # kept alive with the vocabulary it owns
    return grammars
