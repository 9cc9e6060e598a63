"""Stop strings, one set of rules for sampled sequences (LLMEngine) and beams (BeamSearch): the
first stop string in the text wins (the longest of those starting at one place), the output ends
before it (after it with include_stop_str_in_output), and a streamed text holds back a tail that
may still grow into one."""

from __future__ import annotations

from collections.abc import Sequence


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """(where, which) of the first stop string found in text[start:], or None."""
    hits = [(i, s) for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits, key=lambda hit: (hit[0], -len(hit[1]))) if hits else None


def cut_at_stop(text: str, at: int, stop: str, include: bool) -> str:
    """The output's text for a stop string found at `at`: before it, or through it (include)."""
    return text[: at + (len(stop) if include else 0)]


def stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
