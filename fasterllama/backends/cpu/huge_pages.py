"""A CPU model's weights in 2 MB pages.

A decode step streams every weight once. With 4 KB pages the TLB misses every 4 KB and the
hardware prefetchers stop at each page boundary; with 2 MB pages (Linux transparent huge pages,
asked for with madvise) the streams run on. Measured on the 2-core dev VM, weights moved vs left
as loaded, alternating in one process (`python benchmarks/huge_pages.py`): fp32 decode steps
7-12% faster at batch 1 and 4-9% at batch 8, the 4-bit default ~2% at batch 1.

Tensors below IN_PLACE_BYTES are copied, one at a time, into one 2 MB-aligned arena (small
tensors cannot fill a huge page of their own); larger ones (a vocabulary-sized embedding, a 1B
model's matrices) have their pages collapsed where they are (MADV_COLLAPSE, Linux 6.1+), so loading
peaks at the weights plus at most one IN_PLACE_BYTES tensor. The collapse runs on a thread of its
own: where free memory is in pieces the kernel compacts as it goes (9.6 s for a 1.1B model's 2.2 GB
on the dev VM), and since it leaves every address as it is, the model runs meanwhile, its reads
speeding up as pages turn huge (`wait()` waits for it). The KV cache stays in 4 KB pages: a 2 MB page for each
(sequence, layer, head) region would hold memory short sequences never use.
`FASTERLLAMA_HUGE_PAGES=0` leaves the weights where loading put them."""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from ...host_memory import libc, release_freed_memory

PAGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25
MIN_BYTES = 1 << 16  # smaller tensors (norms, biases) stay where they are
IN_PLACE_BYTES = 16 << 20

_arenas: set[int] = set()  # storages made here: a packed model is left alone
_collapsing: list[threading.Thread] = []


def _madvise(start: int, end: int, *advice: int) -> None:
    """Advise [start, end) rounded inwards to whole 2 MB pages (no-op where there is none)."""
    start, end = (start + PAGE - 1) // PAGE * PAGE, end // PAGE * PAGE
    lib = libc()
    if lib is not None and end > start:
        for a in advice:
            lib.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), a)


def _collapse_later(tensors: list[torch.Tensor]) -> None:
    """Ask for huge pages under each tensor now, and collapse its pages into them on a thread. The
    thread keeps addresses, not the tensors: weights a quantize replaces (or a deleted model's) go
    at once, and a collapse of memory freed meanwhile is harmless (unmapped: ENOMEM; reused: the
    contents stay as they are)."""
    ranges = [(t.data_ptr(), t.data_ptr() + _nbytes(t)) for t in tensors]
    for start, end in ranges:
        _madvise(start, end, MADV_HUGEPAGE)

    def collapse() -> None:
        for start, end in ranges:
            _madvise(start, end, MADV_COLLAPSE)  # (ctypes lets go of the GIL)

    _collapsing[:] = [t for t in _collapsing if t.is_alive()]
    thread = threading.Thread(target=collapse, name="fasterllama-huge-pages", daemon=True)
    _collapsing.append(thread)
    thread.start()


def wait() -> None:
    """Until every collapse started so far is done (benchmarks that compare page sizes)."""
    while _collapsing:
        _collapsing.pop().join()


def arena(nbytes: int) -> torch.Tensor:
    """nbytes of uint8 starting on a 2 MB boundary, in huge pages where the OS gives them (the
    memory is untouched: pages arrive on first write)."""
    buf = torch.empty(nbytes + 2 * PAGE, dtype=torch.uint8)  # spare: room to align the start and round the advice up
    start = (-buf.data_ptr()) % PAGE
    _madvise(buf.data_ptr() + start, buf.data_ptr() + start + nbytes + PAGE, MADV_HUGEPAGE)
    return buf[start : start + nbytes]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _large_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's CPU parameters and buffers of MIN_BYTES or more (tied or aliased ones each time)."""
    return [t for t in (*model.parameters(), *model.buffers()) if t.device.type == "cpu" and t.is_contiguous() and _nbytes(t) >= MIN_BYTES]


def pack_weights(model: torch.nn.Module) -> bool:
    """Put the model's large CPU tensors in 2 MB pages, in place: modules keep their Parameter
    objects, whose .data (and the buffers) may now view the arena. False when there was nothing
    to do or it is switched off."""
    if os.environ.get("FASTERLLAMA_HUGE_PAGES", "1") == "0" or libc() is None:
        return False  # switched off, or not Linux: no madvise to ask with
    tensors = _large_tensors(model)
    in_place = [t for t in tensors if _nbytes(t) >= IN_PLACE_BYTES]
    if in_place:
        _collapse_later(in_place)
    to_copy = [t for t in tensors if _nbytes(t) < IN_PLACE_BYTES]
    homes = {t.untyped_storage().data_ptr() for t in to_copy}
    if not to_copy or (len(homes) == 1 and homes <= _arenas):
        return bool(tensors)  # packed already; else (new tensors after a quantize) all move, so no old arena outlives them
    span: dict[int, int] = {}  # address -> bytes from it (the largest of the tensors that start there)
    for t in to_copy:
        span[t.data_ptr()] = max(span.get(t.data_ptr(), 0), _nbytes(t))
    place: dict[int, int] = {}  # old address -> offset in the arena
    offset = 0
    for address, nbytes in span.items():
        place[address] = offset
        offset += (nbytes + 63) // 64 * 64
    space = arena(offset)
    _arenas.add(space.untyped_storage().data_ptr())

    def moved(t: torch.Tensor) -> torch.Tensor | None:
        """t's copy in the arena, with its dtype and shape (None: t does not move)."""
        start = place.get(t.data_ptr())
        if start is None or _nbytes(t) >= IN_PLACE_BYTES:
            return None
        new = space[start : start + _nbytes(t)].view(t.dtype).view(t.shape)
        new.copy_(t)
        return new

    with torch.no_grad():
        for module in model.modules():
            for p in module._parameters.values():
                if p is not None and (new := moved(p)) is not None:
                    p.data = new  # the old storage goes now, unless something else holds it
                    release_freed_memory()
            for name, b in module._buffers.items():
                if b is not None and (new := moved(b)) is not None:
                    module._buffers[name] = new
                    release_freed_memory()
    return True
