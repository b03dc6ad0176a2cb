"""``export``'s choices that need no checkpoint: how a folder is split into shards, and what
an output name means."""

from __future__ import annotations

import pytest

from elastictrain.errors import ConfigError
from elastictrain.tools.export import _kind, shard_groups


def test_shards_hold_consecutive_tensors_up_to_the_limit_and_a_big_one_alone():
    sizes = {"a": 3, "b": 3, "c": 10, "d": 1, "e": 5}
    assert shard_groups(list(sizes), sizes, 6) == [["a", "b"], ["c"], ["d", "e"]]
    assert shard_groups(list(sizes), sizes, 100) == [list(sizes)]


def test_the_output_name_picks_the_format_and_a_wrong_one_is_named(tmp_path):
    assert _kind("m.safetensors") == ".safetensors" and _kind("m.pt") == ".pt"
    assert _kind(str(tmp_path / "folder")) == "folder"
    with pytest.raises(ConfigError, match=r"-o 'model\.bin'.*folder.*\.safetensors.*\.pt"):
        _kind("model.bin")
