"""User-facing errors: the CLI prints these as one line, without a traceback."""


class FasterLlamaError(ValueError):
    """Bad input or an unsupported model: something the user can fix (a ValueError, as vLLM raises
    for bad parameters, so scripts written for it catch these too)."""


class ModelLoadError(FasterLlamaError):
    """A checkpoint is missing, corrupt, or of an architecture/tensor type we do not run."""


class ContextLengthError(FasterLlamaError):
    """A prompt (plus what it must generate) does not fit in the model's context."""
