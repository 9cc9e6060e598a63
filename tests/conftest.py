"""Shared fixtures. The default model (and HF transformers on the same GGUF) load once a session."""

from __future__ import annotations

import os

import pytest
import torch

torch.manual_seed(0)

REAL_MODEL_FIXTURES = {"default_llm", "fp32_llm", "hf_default", "hf_tokenizer"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that load the real default model (in this process or a CLI subprocess) are `slow`:
    `-m "not slow"` is the fast tier, tiny random models only."""
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("real_model"):
            item.add_marker(pytest.mark.slow)


def default_model_path() -> str | None:
    from fasterllama.loading.registry import DEFAULT_MODEL, KNOWN_MODELS

    return KNOWN_MODELS[DEFAULT_MODEL].path()


@pytest.fixture(scope="session")
def default_llm():
    from fasterllama import LLM

    if default_model_path() is None:
        pytest.skip("default model not installed")
    return LLM(progress=False)


@pytest.fixture(scope="session")
def fp32_llm():
    """The default model with every tensor dequantized to fp32 (quantization="none")."""
    from fasterllama import LLM

    if default_model_path() is None:
        pytest.skip("default model not installed")
    return LLM(quantization="none", progress=False)


@pytest.fixture(scope="session")
def hf_tokenizer():
    """HF transformers' tokenizer of the default GGUF (without its model: loading that dequantizes
    every tensor in Python, ~40 s on a slow machine)."""
    path = default_model_path()
    if path is None:
        pytest.skip("default model not installed")
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(path)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="session")
def hf_default(hf_tokenizer):
    """(model, tokenizer) of HF transformers loading the default GGUF in fp32: the reference."""
    path = default_model_path()
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(path)
    tok = hf_tokenizer
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    return model, tok
