"""Names a package exports but imports only when first used: ``python -m elastictrain ls`` and
``import storage`` must not pay for torch through a package's ``__init__``."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

MISSING = object()


def resolve(namespace: dict[str, Any], table: Mapping[str, str], name: str) -> Any:
    """``name`` from the module ``table`` says holds it, kept in ``namespace`` (a package's
    ``globals()``) so later lookups skip the package's ``__getattr__``; ``MISSING`` when the
    table does not list it."""
    if name not in table:
        return MISSING
    value = getattr(importlib.import_module(table[name]), name)
    namespace[name] = value
    return value
