"""Training state: what a checkpoint holds and how it is captured and restored (``train_state``),
and the flat file a replicated state is written as (``flat``)."""

from elastictrain.checkpoint.state.train_state import (
    DataFingerprint,
    TrainState,
    capture,
    check_plain,
    restore,
    unwrap,
)

__all__ = ["DataFingerprint", "TrainState", "capture", "check_plain", "restore", "unwrap"]
