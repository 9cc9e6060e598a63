"""The CPU backend: C kernels (kernels.py, csrc/cpu_kernels.c; built at first use), quantized
weights in the kernels' panels and all weights in 2 MB pages (huge_pages.py), the decode
step as one C call (decode_plan.py), and threads only on the cores other processes leave idle
(core_sharing.py)."""

from __future__ import annotations

import torch
from torch import nn

from ... import ops
from ...host_memory import release_code_pages, release_freed_memory
from .. import Backend, DecodePlan
from . import kernels
from .core_sharing import CoreSharing


def use_cpu_panels(model: nn.Module) -> None:
    """Put every weight-only quantized linear into the CPU kernels' panel layout."""
    from ...quant.linear import _PanelStorage

    for m in model.modules():
        if isinstance(m, _PanelStorage) and m.qweight.device.type == "cpu":
            m.use_panels()


class CPUBackend(Backend):
    default_dtype = torch.float32
    # decode attention streams each sequence's blocks: with 16-token blocks decoding 8 sequences
    # interleaves their blocks and attention ran 1.5x slower than a contiguous cache; at 128, 1.05x
    kv_block_size = 128

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.core_sharing = CoreSharing()
        release_code_pages()  # torch's import-time code, before the weights arrive (the load's peak)

    # a forward of this many tokens (a prefill) hands its freed temporaries back to the OS, which
    # glibc would keep in the heap: malloc_trim costs ~1 ms (1.2% of a 128-token prefill on Zen 5), a
    # 512-token one takes ~0.3 s and frees ~20 MB; a shorter one leaves a few MB in the heap for the next
    TRIM_AFTER_TOKENS = 512

    def begin_step(self) -> None:
        self.core_sharing.update()  # threads: the cores other processes leave idle

    def after_forward(self, num_tokens: int) -> None:
        if num_tokens >= self.TRIM_AFTER_TOKENS:
            release_freed_memory()

    def register_ops(self) -> None:
        """The C kernels for CPU tensors; where they cannot be built, the reference ops stay."""
        kernels.register(ops.register)

    def keeps_gguf_quantized(self, dtype: torch.dtype) -> bool:
        # the C kernels compute with the file's exact floats (the reference would dequantize every
        # matrix at every call: ~0.1 tok/s for the default model, against ~13 expanded once)
        return dtype == torch.float32 and kernels.load() is not None

    def keeps_16bit_weights(self, dtype: torch.dtype) -> bool:
        # the C GEMVs widen them in registers: the fp32 copy's sums from half its bytes (without the
        # kernels, the reference would widen every matrix at every call)
        return dtype == torch.float32 and kernels.load() is not None

    def prepare_model(self, model) -> None:
        from . import huge_pages

        if kernels.load() is not None:  # the C kernels read quantized weights in panels
            use_cpu_panels(model)
        huge_pages.pack_weights(model)
        release_code_pages()  # and the loading's

    def decode_plan(self, model, kv_cache, max_num_seqs: int, max_model_len: int) -> DecodePlan | None:
        from .decode_plan import CPUDecodePlan

        return CPUDecodePlan.build(model, kv_cache.layers)
