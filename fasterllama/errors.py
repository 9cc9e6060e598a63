"""User-facing errors: the CLI prints these as one line, without a traceback."""


class FasterLlamaError(Exception):
    """Bad input or an unsupported model: something the user can fix."""


class ModelLoadError(FasterLlamaError):
    """A checkpoint is missing, corrupt, or of an architecture/tensor type we do not run."""


class ContextLengthError(FasterLlamaError):
    """A prompt (plus what it must generate) does not fit in the model's context."""
