"""The CPU backend: the C kernels (built at first use), weights in the kernels' panels and in 2 MB
pages, and the decode step as one C call."""

from __future__ import annotations

import torch

from ...ops import cpu_kernels, use_cpu_kernels
from .. import Backend, DecodePlan


class CPUBackend(Backend):
    default_dtype = torch.float32

    def register_ops(self) -> None:
        use_cpu_kernels()

    def keeps_gguf_quantized(self, dtype: torch.dtype) -> bool:
        return dtype == torch.float32  # the C kernels compute with the file's exact floats

    def prepare_model(self, model) -> None:
        from ...engine import huge_pages
        from ...quant.linear import use_cpu_panels

        if cpu_kernels.load() is not None:  # the C kernels read quantized weights in panels
            use_cpu_panels(model)
        huge_pages.pack_weights(model)

    def decode_plan(self, model, kv_cache) -> DecodePlan | None:
        from ...engine.cpu_decode_plan import CPUDecodePlan

        return CPUDecodePlan.build(model, kv_cache.layers)
