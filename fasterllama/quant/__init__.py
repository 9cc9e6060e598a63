"""Quantization: int8/int4 weight-only, FasterLLaMA's W8A8 with calibration, GGUF quants kept quantized."""

from .config import QuantConfig
from .convert import quantize_model, weight_bytes

__all__ = ["QuantConfig", "quantize_model", "weight_bytes"]
