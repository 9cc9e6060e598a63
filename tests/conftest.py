"""Shared fixtures. The default model (and HF transformers on the same GGUF) load once a session."""

from __future__ import annotations

import contextlib
import functools
import os
import zlib

import pytest
import torch

torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _seeded(request: pytest.FixtureRequest) -> None:
    """Each test draws its random inputs from a seed of its own name: the same values whatever ran
    before it in its worker (under xdist the order differs run to run, and a test whose claim held
    for most draws but not all failed at random)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)

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


def decode_tolerance() -> float:
    """How far decode steps' log-probabilities may sit from a float forward's (compute_logits, the
    fp32 model): summation order (1e-4) where the GEMVs take fp32 x; 1e-3 where they round x to
    int16 per 8 columns (AVX2 builds, kernels.gemv_x: 6e-4 measured against HF transformers)."""
    from fasterllama.backends.cpu import kernels as ck

    return 1e-3 if ck.gemv_x_block() else 1e-4


def rows_tolerance(rows: int, hidden: int) -> float:
    """decode_tolerance for a step of `rows` rows of width `hidden`: steps of up to 4 rows (decodes,
    and prompts that short) take the GEMVs, which round x to int16 on AVX2; longer ones the exact GEMM."""
    from fasterllama.backends.cpu import kernels as ck

    return 1e-3 if ck.load() is not None and ck._lib.fl_gemv_x_block(rows, hidden, 32) else 1e-4


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


_GGUF_READERS: dict[tuple, object] = {}  # (path, arguments) -> gguf.GGUFReader, for _gguf_read_once


@contextlib.contextmanager
def _gguf_read_once():
    """HF's GGUF loading builds gguf's reader of the file twice per load (and once more for the
    tokenizer) and gguf's tensor-name map once per module: on a slow machine ~11 s a reader and
    ~12 s the maps of the default model. Within this, each is built once in the session and
    reused (the same read-only objects; only for the installed default model's file)."""
    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in _GGUF_READERS:
            _GGUF_READERS[key] = real_reader(path, *args, **kwargs)
        return _GGUF_READERS[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def _shared_by_workers(tmp_path_factory, name: str):
    """A file lock and a path for what one pytest-xdist worker of this run loads and saves for the
    others (None outside xdist)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent / name  # this run's, shared by its workers
    return FileLock(f"{shared}.lock"), shared


@pytest.fixture(scope="session")
def hf_tokenizer(tmp_path_factory):
    """HF transformers' tokenizer of the default GGUF (without its model: loading that dequantizes
    every tensor in Python, ~40 s on a slow machine). Reading the GGUF's vocabulary takes HF ~10 s:
    under pytest-xdist the first worker saves the tokenizer (save_pretrained) for the others (0.3 s)."""
    path = default_model_path()
    if path is None:
        pytest.skip("default model not installed")
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(path)
    def from_gguf():
        with _gguf_read_once():
            tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        # SmolLM2's own tokenizer.json (HuggingFaceTB/SmolLM2-135M-Instruct) splits every digit off
        # before the byte-level split, as llama.cpp does for the file's `tokenizer.ggml.pre =
        # smollm`; transformers' GGUF reader leaves that step out ("a  1": "a", " ", " ", "1").
        from tokenizers import pre_tokenizers

        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        return tokenizer

    lock_and_path = _shared_by_workers(tmp_path_factory, "hf_tokenizer")
    if lock_and_path is None:
        return from_gguf()
    lock, saved = lock_and_path
    with lock:
        if saved.is_dir():
            return transformers.AutoTokenizer.from_pretrained(saved)
        tokenizer = from_gguf()
        tokenizer.save_pretrained(saved)
        return tokenizer


@pytest.fixture(scope="session")
def hf_default(hf_tokenizer, tmp_path_factory):
    """(model, tokenizer) of HF transformers loading the default GGUF in fp32: the reference.
    HF's GGUF load parses the file's metadata in Python (~4 s on a slow machine after
    hf_tokenizer's, with _gguf_read_once: ~50 s without), so under pytest-xdist the first worker saves what it loaded (its config and state dict, the same fp32
    values) for the others to read back (~3 s)."""
    path = default_model_path()
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(path)

    def from_gguf():
        with _gguf_read_once():
            return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)

    lock_and_path = _shared_by_workers(tmp_path_factory, "hf_default.pt")
    if lock_and_path is None:
        model = from_gguf()
    else:
        lock, shared = lock_and_path
        with lock:
            if shared.is_file():
                saved = torch.load(shared, weights_only=True)
                config = transformers.AutoConfig.for_model(**saved["config"])
                model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
                model.load_state_dict(saved["state"])
            else:
                model = from_gguf()
                config = {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}  # (HF's GGUF marker)
                torch.save({"config": config, "state": model.state_dict()}, shared)
    model.eval()
    return model, hf_tokenizer
