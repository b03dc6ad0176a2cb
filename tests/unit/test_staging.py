"""The flat checkpoint format and its reused staging buffer."""

from __future__ import annotations

import io
import os
import pickle
import struct
from collections import OrderedDict

import pytest
import torch

from elastictrain.checkpoint.state import flat as staging
from elastictrain.checkpoint.state.train_state import from_bytes, from_bytes_file
from elastictrain.errors import UnsafeCheckpointError


def _state():
    g = torch.Generator().manual_seed(0)
    return {
        "model": OrderedDict(
            w=torch.randn(7, 3, generator=g),
            half=torch.randn(5, generator=g).to(torch.bfloat16),
            f16=torch.randn(3, generator=g).half(),
            idx=torch.arange(9, dtype=torch.int64),
            mask=torch.tensor([True, False, True]),
            empty=torch.empty(0, 4),
            scalar=torch.tensor(3.5),
            strided=torch.randn(4, 6, generator=g).t(),  # not contiguous
        ),
        "optimizer": {
            "state": {0: {"step": torch.tensor(12.0)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0], "foreach": None}],
        },
        "progress": {"step": 12},
    }


def _assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def test_roundtrip_is_exact_for_every_dtype_and_keeps_container_types():
    state = _state()
    data = bytes(staging.Staging().snapshot(state).data)
    assert staging.is_flat(data)
    _assert_same(from_bytes(data), state)


def test_staging_buffer_is_reused_and_snapshots_are_consistent_copies():
    buffers = staging.Staging()
    state = _state()
    first = buffers.snapshot(state)
    ptr, size = buffers.buffer.data_ptr(), buffers.nbytes
    saved, before = bytes(first.data), state["model"]["w"].clone()
    state["model"]["w"].add_(1)  # training goes on after the snapshot...
    assert from_bytes(saved)["model"]["w"].equal(before)  # ...the copy did not
    second = buffers.snapshot(state)
    assert buffers.buffer.data_ptr() == ptr and buffers.nbytes == size  # no new allocation
    assert from_bytes(bytes(second.data))["model"]["w"].equal(state["model"]["w"])


def test_loaded_tensors_are_writable_views_that_training_may_update():
    data = bytearray(staging.Staging().snapshot(_state()).data)
    loaded = from_bytes(data)
    loaded["model"]["w"].add_(1)  # e.g. an optimizer updating restored momentum in place
    assert from_bytes(bytes(data))["model"]["w"].equal(loaded["model"]["w"])


def test_meta_load_reads_only_the_tail():
    data = bytes(staging.Staging().snapshot(_state()).data)
    meta = from_bytes_file(io.BytesIO(data), map_location="meta")
    assert meta["model"]["w"].device.type == "meta" and meta["model"]["w"].shape == (7, 3)
    assert meta["progress"] == {"step": 12}


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/elastictrain-pwned",))


# The forged pickle is protocol 4 on purpose; torch warns about the protocol before refusing it.
@pytest.mark.filterwarnings("ignore:Detected pickle protocol 4:UserWarning")
def test_a_malicious_skeleton_is_refused_and_never_executed(tmp_path):
    data = bytearray(staging.Staging().snapshot({"progress": {"step": 1}}).data)
    header_len, _ = struct.unpack_from("<Q8s", data, len(data) - 16)
    evil = pickle.dumps(_Boom())
    # Swap the skeleton for a raw pickle that would run code if unpickled without weights_only.
    header = bytes(data[len(data) - 16 - header_len : len(data) - 16])
    header = header.replace(b'"skeleton_bytes":', b'"skeleton_bytes":%d,"x":' % len(evil), 1)
    forged = evil + header + struct.pack("<Q8s", len(header), staging.MAGIC)
    marker = "/tmp/elastictrain-pwned"
    if os.path.exists(marker):
        os.unlink(marker)
    with pytest.raises(UnsafeCheckpointError):
        from_bytes(forged)
    assert not os.path.exists(marker)


def test_sparse_tensors_are_refused_with_a_clear_error():
    with pytest.raises(TypeError, match="only dense tensors"):
        staging.Staging().snapshot({"s": torch.eye(3).to_sparse()})
