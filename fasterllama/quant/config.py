"""QuantConfig: which quantization mode, parsed from a short spec string.

    w8            int8 weights, per output channel        w8-g32    int8 weights, groups of 32
    w4            4-bit weights, groups of 32 (-g64/-g128) w8a8      int8 weights + dynamic per-token int8 activations
                  w4's group scales and mins are searched for the least error weighted by the
                  calibration text's activations (an importance matrix); -noimatrix: unweighted;
                  -sym: GGUF Q4_0's symmetric groups instead (a scale, no min: on the GPU 4.5 bits
                  a weight, not 5; less accurate)
    w8a8-static[-percentile[P]|-max|-mse|-entropy]  static per-tensor activation scales from calibration
                  (default: the 99.99th percentile of |x|)
    w8a8 modes smooth activations with SmoothQuant (alpha 0.6 dynamic, 0.7 static); -sqALPHA
    sets alpha, -nosq turns it off. Under a static scale, a token whose activations exceed the
    calibrated range (attention sinks, massive-activation tokens) takes its own per-token scale;
    -clip saturates it instead (classic static quantization)
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from ..errors import FasterLlamaError

MODES = ("w8", "w4", "w8a8")
CALIBRATORS = ("max", "percentile", "mse", "entropy")


@dataclass
class QuantConfig:
    mode: str
    group_size: int | None = None  # w8: None = per channel; w4: 32/64/128
    static_activations: bool = False  # w8a8 only
    calibrator: str = "percentile"  # static w8a8; chosen on held-out text (benchmarks/quantization.py --eval-files)
    percentile: float = 99.99
    smoothquant_alpha: float | None = None  # w8a8 only: SmoothQuant migration strength (None: 0.6 dynamic, 0.7 static)
    clip: bool = False  # static w8a8: out-of-range tokens saturate (True) or take their own per-token scale
    int8_lm_head: bool = False  # w8a8: set when quantizing; the lm_head held exactly by int8 groups of 32
    # w4: bits of the lm_head / embedding. 8 (int8 groups of 32) by default: in 4 bits that one
    # matrix cost SmolLM2 5-7% perplexity, nearly all of w4-g32's loss (llama.cpp keeps output.weight
    # at Q6_K or Q8_0 too); "-head4" asks for 4
    head_bits: int | None = None
    # w4: weight each group's scale/min search by the mean x^2 of the input channel (from the
    # calibration text): w4-g64 / -g128 lost 28% / 36% perplexity with the plain search, 6% / 7%
    # with it (docs/quantization.md)
    imatrix: bool | None = None
    symmetric: bool = False  # w4: Q4_0's groups, w = scale * (q - 8) (quantize_q4_0)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise FasterLlamaError(f"unknown quantization mode {self.mode!r} (use {', '.join(MODES)})")
        if self.mode == "w4" and self.group_size is None:
            self.group_size = 32
        if self.mode == "w4" and self.head_bits is None:
            self.head_bits = 8
        if self.symmetric and self.mode != "w4":
            raise FasterLlamaError("symmetric groups (-sym) apply to w4 only")
        if self.symmetric and self.imatrix:
            raise FasterLlamaError("w4-sym takes Q4_0's scales as they are: no importance matrix")
        if self.mode == "w4" and self.imatrix is None:
            self.imatrix = not self.symmetric
        if self.imatrix is not None and self.mode != "w4":
            raise FasterLlamaError("an importance matrix applies to w4 only")
        if self.head_bits is not None and (self.mode != "w4" or self.head_bits not in (4, 8)):
            raise FasterLlamaError(f"head bits apply to w4 only and are 4 or 8, got {self.head_bits} for {self.mode}")
        if self.mode == "w8a8" and self.smoothquant_alpha is None:
            self.smoothquant_alpha = 0.7 if self.static_activations else 0.6  # chosen on held-out text
        if self.smoothquant_alpha is not None and self.smoothquant_alpha < 0:  # "nosq"
            self.smoothquant_alpha = None
        if self.group_size is not None and self.group_size not in (32, 64, 128):
            raise FasterLlamaError(f"group size must be 32, 64 or 128, got {self.group_size}")
        if self.mode == "w8a8" and self.group_size is not None:
            raise FasterLlamaError("w8a8 uses per-channel weight scales (no group size)")
        if self.calibrator not in CALIBRATORS:
            raise FasterLlamaError(f"unknown calibrator {self.calibrator!r} (use {', '.join(CALIBRATORS)})")
        if not 50 < self.percentile <= 100:
            raise FasterLlamaError(f"percentile must be in (50, 100], got {self.percentile}")
        if self.smoothquant_alpha is not None and not 0 < self.smoothquant_alpha <= 1:
            raise FasterLlamaError(f"SmoothQuant alpha must be in [0, 1], got {self.smoothquant_alpha}")
        if self.mode != "w8a8" and (self.static_activations or self.smoothquant_alpha is not None):
            raise FasterLlamaError("static activation scales and SmoothQuant apply to w8a8 only")

    @property
    def head(self) -> QuantConfig:
        """How the lm_head / embedding is quantized: as the layers for w8 and w4-head4, else int8
        groups of 32 (w8a8 uses them only where they hold a GGUF's Q8_0 head exactly)."""
        return self if self.mode == "w8" or self.head_bits == 4 else QuantConfig("w8", group_size=32)

    @property
    def needs_calibration(self) -> bool:
        return self.static_activations or self.smoothquant_alpha is not None or bool(self.imatrix)

    @classmethod
    def parse(cls, spec: str | QuantConfig) -> QuantConfig:
        if isinstance(spec, QuantConfig):
            return spec
        parts = spec.strip().lower().split("-")
        kw: dict = {"mode": parts[0]}
        for part in parts[1:]:
            if m := re.fullmatch(r"g(\d+)", part):
                kw["group_size"] = int(m.group(1))
            elif part == "static":
                kw["static_activations"] = True
            elif part == "dynamic":
                kw["static_activations"] = False
            elif m := re.fullmatch(r"percentile([\d.]+)?", part):
                kw["calibrator"] = "percentile"
                if m.group(1):
                    kw["percentile"] = float(m.group(1))
            elif part in CALIBRATORS:
                kw["calibrator"] = part
            elif m := re.fullmatch(r"sq([\d.]+)", part):
                kw["smoothquant_alpha"] = float(m.group(1))
            elif part in ("clip", "nosink"):  # nosink: this option's earlier name
                kw["clip"] = True
            elif part == "nosq":
                kw["smoothquant_alpha"] = -1.0
            elif m := re.fullmatch(r"head(\d+)", part):
                kw["head_bits"] = int(m.group(1))
            elif part == "noimatrix":
                kw["imatrix"] = False
            elif part == "sym":
                kw["symmetric"] = True
            else:
                raise FasterLlamaError(f"cannot read quantization spec {spec!r} at {part!r} (e.g. w8, w8-g32, w4-g64, w8a8, w8a8-static-mse-sq0.5)")
        return cls(**kw)

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        s = self.mode + (f"-g{self.group_size}" if self.group_size else "") + ("-head4" if self.head_bits == 4 else "")
        s += "-sym" if self.symmetric else "-noimatrix" if self.mode == "w4" and not self.imatrix else ""
        if self.static_activations:
            s += "-static-" + (f"percentile{self.percentile:g}" if self.calibrator == "percentile" else self.calibrator)
            s += "-clip" if self.clip else ""
        if self.mode == "w8a8":
            s += f"-sq{self.smoothquant_alpha:g}" if self.smoothquant_alpha is not None else "-nosq"
        return s
