"""A membership epoch's data (``--replace-in-place``): the bounds every epoch is built within, and
the epoch a process is in once formed; ``driver`` moves a process through them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from elastictrain.cluster.env import DistEnv
from elastictrain.cluster.groups import ProcessGroups
from elastictrain.cluster.liveness import Liveness
from elastictrain.inplace.epoch_end import EpochEnd
from elastictrain.inplace.members import LiveState


@dataclass(frozen=True)
class EpochSettings:
    """The bounds of every epoch, by the names the user set them with (``flags``)."""

    replace_in_place: bool
    init_timeout: float
    collective_timeout: float
    checkpoint_timeout: float
    replace_wait: float
    replace_timeout: float
    silent_timeout: float
    beat_s: float
    init_flag: str = "--init-timeout"
    replace_flag: str = "--replace-timeout"


@dataclass
class Epoch:
    """The membership epoch this process is in, once formed."""

    env: DistEnv
    """This epoch's identity of the rank: its rank among the members, the members' count."""
    members: list[int]
    """The epoch's torchrun ranks, in its rank order."""
    groups: ProcessGroups
    liveness: Liveness
    end: EpochEnd | None
    """Its end: fails its collectives when announced or when a member is silent (in place)."""
    carry: LiveState | None = None
    """A survivor's state from the epoch before."""
    died_at: float | None = None
    """A replacement's first epoch: when the death it replaces was seen."""
    took_over: list[list[int]] = dataclasses.field(default_factory=list)
    """``[lost, spare]`` torchrun ranks: a spare node's rank in a lost one's place
    (``inplace.spares``)."""

    @property
    def in_place(self) -> bool:
        return self.carry is not None or self.died_at is not None

    @property
    def dropped(self) -> list[int]:
        """The epoch before's members not back (a lost node), by torchrun rank."""
        return sorted(set(self.carry.members) - set(self.members)) if self.carry else []
