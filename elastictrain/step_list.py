"""Lists of global steps as flags spell them: ``120,130-135`` (``--skip-steps``). Torch-free:
flags are parsed before torch is imported."""

from __future__ import annotations

from collections.abc import Iterable

from elastictrain.errors import ConfigError


def parse_steps(spec: str | None, name: str = "--skip-steps") -> frozenset[int]:
    """``"120,130-135"`` -> {120, 130, ..., 135}: 0-based global steps."""
    steps: set[int] = set()
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        first, _, last = part.partition("-")
        try:
            lo, hi = int(first), int(last or first)
        except ValueError:
            raise ConfigError(
                f"{name} {spec!r}: {part!r} is not a step or a range A-B of steps "
                "(0-based global steps, e.g. 120,130-135)."
            ) from None
        if lo < 0 or hi < lo:
            raise ConfigError(f"{name} {spec!r}: {part!r} must be 0 or more, and A <= B.")
        steps.update(range(lo, hi + 1))
    return frozenset(steps)


def format_steps(steps: Iterable[int]) -> str:
    """{120, 130, 131, 132} -> ``"120,130-132"``: what ``--skip-steps`` takes."""
    ordered, parts = sorted(set(steps)), []
    for s in ordered:
        if parts and s == parts[-1][1] + 1:
            parts[-1][1] = s
        else:
            parts.append([s, s])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)
