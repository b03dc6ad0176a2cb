"""CheckpointManager's keyword arguments: the runner's checkpoint flags by the same names, the
names of earlier releases, and the signature ``help()`` and IDEs show."""

from __future__ import annotations

import difflib
import inspect
import warnings
from typing import Any

from elastictrain.config import CheckpointConfig, settings
from elastictrain.errors import ConfigError

SETTINGS = settings(CheckpointConfig)

# The keywords of earlier releases, accepted for one more with a warning naming the new one.
RENAMED = {
    "url": "checkpoint_dir",
    "every_steps": "checkpoint_every_steps",
    "every_seconds": "checkpoint_every_seconds",
    "async_save": "async_checkpoint",
    "timeout_s": "checkpoint_timeout",
}


def config_from(checkpoint_dir: str | None, given: dict[str, Any]) -> CheckpointConfig:
    """The settings as a config; an unknown or missing one raises :class:`ConfigError` naming it."""
    given = _renamed(given)
    if checkpoint_dir is not None:
        given["checkpoint_dir"] = checkpoint_dir
    unknown = sorted(set(given) - set(SETTINGS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], SETTINGS, n=1)
        hint = f"; did you mean {close[0]}?" if close else f"; it takes {', '.join(SETTINGS)}"
        raise ConfigError(f"CheckpointManager got an unknown argument {unknown[0]!r}{hint}")
    if "checkpoint_dir" not in given:
        raise ConfigError(
            "CheckpointManager needs checkpoint_dir: a local path or any fsspec URL, e.g. "
            "CheckpointManager('s3://bucket/run1')."
        )
    return CheckpointConfig(**given)


def signature() -> inspect.Signature:
    """What ``help(CheckpointManager)`` and IDEs show: every setting by name, with its default."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    defaults = CheckpointConfig(checkpoint_every_steps=None)
    params = [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("checkpoint_dir", inspect.Parameter.POSITIONAL_OR_KEYWORD),
    ]
    params += [
        inspect.Parameter(name, keyword, default=getattr(defaults, name))
        for name in SETTINGS
        if name != "checkpoint_dir"
    ]
    params += [
        inspect.Parameter("map_location", keyword, default=None),
        inspect.Parameter("hang_timeout", keyword, default=None),
    ]
    return inspect.Signature(params, return_annotation=None)


def _renamed(given: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, value in given.items():
        if name in RENAMED:
            warnings.warn(
                f"CheckpointManager({name}=...) is deprecated: use {RENAMED[name]}=...",
                FutureWarning,
                stacklevel=4,  # _renamed, config_from, CheckpointManager.__init__, the caller
            )
            name = RENAMED[name]
        out[name] = value
    return out
