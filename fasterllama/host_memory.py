"""Memory: how much is free (for the weights and the KV cache), and host (CPU) memory the process
holds but no longer uses. glibc keeps freed heap pages for
reuse, and after freeing one large block it raises its threshold for returning memory (up to 32 MB
blocks stay in the heap): loading a model frees thousands of decoded-then-repacked temporaries,
which would otherwise sit on top of the weights at the peak. And importing torch runs code all over
its libraries (op registrations, static initializers) whose pages then stay resident though a
generation runs little of it. Linux with glibc; a no-op elsewhere."""

from __future__ import annotations

import ctypes
import functools
import re
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MADV_DONTNEED = 4
TORCH_LIBRARIES = re.compile(r"/libtorch[^/]*\.so")


def free_memory(device: torch.device, with_swap: bool = False, unknown: int | None = 8 << 30) -> int | None:
    """Bytes free now: the GPU's free memory, or the host's MemAvailable (+ SwapFree with_swap);
    `unknown` where the host does not say (no /proc/meminfo: not Linux)."""
    if device.type == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0]
    fields = {}
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if "MemAvailable" not in fields:
        return unknown
    return fields["MemAvailable"] + (fields.get("SwapFree", 0) if with_swap else 0)


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The C library (madvise, malloc_trim), or None where it is not Linux's."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS now (malloc_trim: ~0.3-3 ms, so not once a step)."""
    lib = libc()
    if lib is not None and hasattr(lib, "malloc_trim"):
        lib.malloc_trim(0)


def release_code_pages(libraries: re.Pattern = TORCH_LIBRARIES) -> int:
    """Drop the machine code of `libraries` (their r-xp mappings: file-backed and never written, so
    nothing is lost) from the resident set; returns the bytes advised. After `import torch` 56 of
    its 218 MB here are libtorch's code, most of it run once at import or while loading; the pages a
    later step runs fault back in from the page cache (minor faults, once), so what stays resident
    is the code that runs. The page cache may keep the rest for other processes: this lowers the
    process's resident memory, not what the file system caches."""
    lib = libc()
    if lib is None or not hasattr(lib, "madvise"):
        return 0
    try:
        with open("/proc/self/maps") as fh:
            maps = fh.read().splitlines()
    except OSError:
        return 0
    total = 0
    for line in maps:
        parts = line.split()
        if len(parts) >= 6 and parts[1] == "r-xp" and libraries.search(parts[5]):
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if lib.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED) == 0:
                total += end - start
    return total
