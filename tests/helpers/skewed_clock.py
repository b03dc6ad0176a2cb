"""A task whose non-zero ranks believe a time-based checkpoint is always due.

``--task tests.helpers.skewed_clock:make_task`` returns the toy task, after making every rank but
rank 0 see a clock that has run far ahead. Only rank 0's clock may decide; a rank that acted on its
own would save at steps where the others do not, and with ``--no-async-checkpoint`` its save
barrier would meet another rank's step collective and fail.
"""

from __future__ import annotations

import os

from elastictrain.checkpoint.schedule import CheckpointSchedule
from elastictrain.toy import make_task as make_toy_task


def make_task(options):
    if int(os.environ.get("RANK", "0")) != 0:
        CheckpointSchedule.due_by_time = lambda self: self.uses_time
    return make_toy_task(options)
