"""Sizes as people type them: 512MB, 1.5GiB."""

from __future__ import annotations

import argparse
import re

_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 512MB or 2GB, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])
