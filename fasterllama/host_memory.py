"""Host (CPU) memory the process holds but no longer uses. glibc keeps freed heap pages for
reuse, and after freeing one large block it raises its threshold for returning memory (up to 32 MB
blocks stay in the heap): loading a model frees thousands of decoded-then-repacked temporaries,
which would otherwise sit on top of the weights at the peak. Linux with glibc; a no-op elsewhere."""

from __future__ import annotations

import ctypes
import functools
import sys


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
