"""Training state: what a checkpoint holds and how it is captured and restored (``train_state``),
the flat file a replicated state is written as (``flat``), and DCP's state dicts of a sharded
one, taken without changing the optimizer (``dcp``)."""

from elastictrain.checkpoint.state.train_state import (
    DataFingerprint,
    TrainState,
    capture,
    check_plain,
    restore,
    unwrap,
)

__all__ = ["DataFingerprint", "TrainState", "capture", "check_plain", "restore", "unwrap"]
