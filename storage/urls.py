"""The one place that parses checkpoint URLs.

Paths stay ``str`` throughout: a checkpoint location may be a remote URI that ``pathlib`` would mangle.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

import fsspec
from fsspec.core import split_protocol

from storage.errors import StorageConfigError

# Option names whose values must never reach a log line, an event or an error message.
_SECRET_OPTION = re.compile(r"(secret|password|token|credential|key$|^key|session)", re.IGNORECASE)
_URL_USERINFO = re.compile(r"^([a-zA-Z][\w+.-]*://)[^/@]*@")


def redact_url(url: str) -> str:
    """``url`` with any ``user:password@`` part replaced, safe to log."""
    return _URL_USERINFO.sub(r"\1***@", url)


def redact_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with the values of secret-looking keys replaced, safe to log."""
    return {k: ("***" if _SECRET_OPTION.search(k) else v) for k, v in options.items()}


def parse_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` from a command line into one fsspec option.

    Values are strings, except ``true``/``false`` (booleans: the string "false" would be truthy)
    and values starting with ``{`` or ``[``, which are JSON, for nested options such as
    ``config_kwargs={"retries": {"total_max_attempts": 10}}``.
    """
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise StorageConfigError(f"Expected a storage option as KEY=VALUE, got {text!r}.")
    if value.lower() in ("true", "false"):
        return key, value.lower() == "true"
    if value.lstrip().startswith(("{", "[")):
        try:
            return key, json.loads(value)
        except json.JSONDecodeError as e:
            shown = "***" if _SECRET_OPTION.search(key) else repr(value)
            raise StorageConfigError(
                f"Storage option {key!r} looks like JSON but does not parse ({e}): {shown}. "
                "Quote it for the shell, e.g. --storage-option 'config_kwargs={\"retries\": {}}'."
            ) from e
    return key, value


def is_local(url: str) -> bool:
    protocol, _ = split_protocol(url)
    return protocol in (None, "file", "local")


def open_url(
    url: str, options: Mapping[str, Any] | None = None
) -> tuple[fsspec.AbstractFileSystem, str]:
    """Open ``url`` into ``(filesystem, root path)``.

    A plain path is a local path (made absolute, so a later ``chdir`` cannot move the checkpoints).
    """
    if not isinstance(url, str) or not url.strip():
        raise StorageConfigError(
            f"Checkpoint URL must be a non-empty string, got {url!r}. "
            "Pass a local path, file://..., s3://bucket/prefix, memory://name or another fsspec URL."
        )
    protocol, path = split_protocol(url)
    options = dict(options or {})
    if protocol in (None, "file", "local"):
        return fsspec.filesystem("file", **options), os.path.abspath(os.path.expanduser(path))
    try:
        fs_cls = fsspec.get_filesystem_class(protocol)
    except (ValueError, ImportError) as e:
        raise StorageConfigError(
            f"Cannot open checkpoint URL {redact_url(url)!r}: protocol {protocol!r} is not available "
            f"({e}). Check the spelling, or install its fsspec backend (for s3://: pip install s3fs)."
        ) from e
    try:
        fs = fs_cls(**options)
    except TypeError as e:
        raise StorageConfigError(
            f"Bad storage options {sorted(redact_options(options))} for {redact_url(url)!r}: {e}. "
            "Check the --storage-option names against the fsspec backend's documentation."
        ) from e
    return fs, fs._strip_protocol(url).rstrip("/")
