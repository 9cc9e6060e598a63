"""Host-side arithmetic of the kernels' launchers (grid sizes, power-of-two blocks).

Triton 3.6 makes `triton.cdiv` and `triton.next_power_of_2` constexpr functions: ~1.6 us a call
from the host, where the arithmetic takes ~0.02. An eager prefill step calls them ~1,000 times
(~350 launches), so the launchers use these instead; the kernels keep `tl.cdiv`."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for 0, as triton.next_power_of_2)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
