"""DCP's state-dict API (``get_state_dict``, ``set_state_dict``) without its side effect on an
optimizer that has not stepped yet. Every sharded capture and load goes through here.

DCP describes an optimizer by its state tensors, so before it reads or loads one that has none
(no step applied yet: a fresh start, or only skipped steps so far) it creates them by running the
optimizer once at lr 0 on zero gradients (torch's ``_init_optim_state``). The parameters stay as
they were, but the optimizer has taken a step: Adam's step count is 1, so every later update's
bias correction is one step off, and the run no longer trains what one rank trains (1.5e-2
apart after 150 steps at every sharded layout alike: docs/layouts.md). So:

- a capture for saving leaves such an optimizer as it was and describes it as it is, with no
  state (as ``Optimizer.state_dict`` and the replicated format describe it);
- a load's targets do get DCP's initialised state, to have tensors to read into, except for a
  checkpoint whose optimizer had no state: its load leaves the optimizer without state.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def state_dicts(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, targets: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """DCP's (model, optimizer) state dicts, keyed by parameter name. ``targets``: for a load
    to read into, with an optimizer that has not stepped given DCP's initialised state; else the
    optimizer is left untouched and such an optimizer's state dict has no state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    fresh = not optimizer.state
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if fresh and not targets:
        optimizer.state.clear()  # DCP's step at lr 0 undone: nothing else of it remains
        optim_sd = {**optim_sd, "state": {}}
    return model_sd, optim_sd


def load_state_dicts(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_sd: dict[str, Any],
    optim_sd: dict[str, Any],
    options: Any = None,
) -> None:
    """DCP's ``set_state_dict``. An optimizer state dict with no state (saved before any step
    was applied) leaves the optimizer with none: DCP creates the state first and then loads the
    empty one over it, as ``Optimizer.load_state_dict`` does (``tests/unit/test_dcp.py``)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(
        model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options
    )


def without_optimizer_state(targets: dict[str, Any], common: Any) -> dict[str, Any]:
    """A load's targets (path -> tensor, from ``split``) less the optimizer's state tensors when
    the checkpoint's optimizer had no state (``common``: its tree without the tensors); the same
    targets otherwise."""
    if common.get("optimizer", {}).get("state"):
        return targets
    return {path: t for path, t in targets.items() if not path.startswith("optimizer/state/")}
