"""Verified reads of byte ranges of a block-hashed file: read only what is needed, trust none of it.

A reader asks for ranges; each is widened to whole blocks (the unit that has a digest), overlapping
or touching spans are merged into one read, every block is checked against its digest, and the
caller gets views of exactly the bytes it asked for. The cost over the bytes needed is at most one
block on each side of each merged span.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from storage.hashing import hex_digest

Range = tuple[int, int]  # [start, end) in bytes


@dataclass(frozen=True)
class Span:
    """A block-aligned region read in one request."""

    start: int
    end: int


def spans_for(ranges: Sequence[Range], block_size: int, size: int) -> list[Span]:
    """The block-aligned spans that cover ``ranges``, merged, in file order."""
    widened = sorted(
        (start - start % block_size, min(size, -(-end // block_size) * block_size))
        for start, end in ranges
        if end > start
    )
    spans: list[Span] = []
    for start, end in widened:
        if spans and start <= spans[-1].end:
            spans[-1] = Span(spans[-1].start, max(spans[-1].end, end))
        else:
            spans.append(Span(start, end))
    return spans


def bad_block(
    data: bytes, span: Span, block_size: int, blocks: Sequence[str], algorithm: str
) -> str | None:
    """A description of the first block of ``span`` whose bytes do not match, or None."""
    if len(data) != span.end - span.start:
        return f"bytes {span.start}-{span.end} read back {len(data)} bytes (truncated)"
    view = memoryview(data)
    for offset in range(0, len(data), block_size):
        index = (span.start + offset) // block_size
        block = view[offset : offset + block_size]
        if index >= len(blocks) or hex_digest(block, algorithm) != blocks[index]:
            return f"block {index} (bytes {span.start + offset}-) does not match its digest"
    return None


def read_verified(
    read: Callable[[int, int], bytes],
    ranges: Sequence[Range],
    *,
    size: int,
    block_size: int,
    blocks: Sequence[str],
    fail: Callable[[str], Exception],
    algorithm: str,
) -> tuple[dict[Range, memoryview], int]:
    """``read(start, end)`` each span once (twice when a block mismatches: a flaky network must
    not get a good checkpoint skipped); returns a view per requested range and the bytes read.
    Raises ``fail(problem)`` when a span stays wrong."""
    for start, end in ranges:
        if end > size or start < 0:
            raise fail(f"range {start}-{end} lies outside the file's recorded {size} bytes")
    out: dict[Range, memoryview] = {}
    total = 0
    for span in spans_for(ranges, block_size, size):
        problem = None
        for _ in range(2):
            data = read(span.start, span.end)
            total += len(data)
            problem = bad_block(data, span, block_size, blocks, algorithm)
            if problem is None:
                break
        if problem is not None:
            raise fail(problem)
        view = memoryview(data)
        for start, end in ranges:
            if span.start <= start and end <= span.end:
                out[(start, end)] = view[start - span.start : end - span.start]
    for start, end in ranges:
        out.setdefault((start, end), memoryview(b""))  # the empty ones
    return out, total
