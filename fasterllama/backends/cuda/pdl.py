"""Programmatic dependent launch (Hopper and later) for every Triton kernel here.

A decode step is hundreds of small kernels, and inside a CUDA graph each still waits for the one
before it to end before the GPU starts launching it (~2 us a boundary). Launched with PDL, a
kernel's programs are placed on the SMs while the kernel before still runs; each program waits
in `wait_prior` (griddepcontrol.wait) until that kernel has ended and its writes are visible, then lets
the next kernel launch (griddepcontrol.launch_dependents). Every kernel launched so calls `wait_prior`
first, before it touches memory: the kernel before may still be reading what it would write (a
buffer the allocator handed on). Kernels launched without PDL (cuBLAS, torch's) keep the
stream's full ordering on both sides. FASTERLLAMA_NO_PDL=1 turns it off."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

OFF = os.environ.get("FASTERLLAMA_NO_PDL") == "1" or os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def launch_args(t: torch.Tensor) -> dict:
    """A kernel's launch arguments for data on t's device: PDL=True and launch_pdl where it runs."""
    if OFF or not t.is_cuda or not _supported(t.device.index if t.device.index is not None else torch.cuda.current_device()):
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True}


@triton.jit
def wait_prior(PDL: tl.constexpr):
    """A kernel's first call: wait for the kernel before to end, then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
