"""The GPU tier: the CUDA paths, on real devices. Every test is marked ``gpu`` and skipped without
CUDA, so CI stays green on CPU; ``bash tests/gpu/run.sh`` runs them all on a GPU machine and prints
a summary. Lines starting ``GPU-FIGURE`` are the measurements the summary repeats."""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch import nn

from elastictrain.observe.events import Event, read_events
from tests.helpers.launcher import (
    REPO_ROOT,
    assert_bitwise_equal,
    final_state,
    run_single,
    toy_args,
    wait_for_event,
)

pytestmark = pytest.mark.gpu


def figure(name: str, **values) -> None:
    print(f"\nGPU-FIGURE {name}: {json.dumps(values)}")


@pytest.mark.parametrize(
    "parallel,precision",
    [("ddp", "fp32"), ("ddp", "fp16"), ("ddp", "bf16"), ("fsdp", "fp32"), ("fsdp", "bf16")],
)
def test_one_process_on_cuda_killed_and_resumed_bitwise(launch, tmp_path, parallel, precision):
    """torchrun, one worker on cuda:0 with nccl; SIGKILLed mid-run, resumed from its checkpoint
    (map_location: the rank's device); fp16 carries its GradScaler state through the restart.
    Under FSDP2 the sharded layout stages DTensor shards that live on the GPU."""
    extra = ("--parallel", parallel, "--precision", precision,
             "--task-option", "hidden=256", "--task-option", "layers=3")  # fmt: skip
    ref_dir, run_dir, ev = tmp_path / "ref", tmp_path / "run", str(tmp_path / "run.jsonl")
    ref = launch(toy_args(str(ref_dir), str(tmp_path / "ref.jsonl"), extra=extra), nproc=1)
    assert ref.wait(300) == 0, ref.log()[-3000:]
    assert "device cuda:0" in ref.log(), "the worker did not train on the GPU"
    job = launch(toy_args(str(run_dir), ev, extra=extra), nproc=1, name="killed")
    wait_for_event(ev, lambda e: e["event"] == Event.CHECKPOINT, 120, job)
    time.sleep(0.3)
    job.kill_worker(0)
    assert job.wait(300) == 0, job.log()[-3000:]
    resumes = [e for e in read_events(ev) if e["event"] == Event.RESUME]
    assert [r["fresh"] for r in resumes] == [True, False], resumes
    got, want = final_state(str(run_dir)), final_state(str(ref_dir))
    assert_bitwise_equal(got, want)
    if precision == "fp16":
        assert got["scaler"] == want["scaler"], (got["scaler"], want["scaler"])
    figure(
        f"cuda-resume-{parallel}-{precision}", resumed_from=resumes[1]["step"], bitwise_equal=True
    )


def test_pinned_side_stream_snapshot_blocks_only_for_the_device_to_host_copy():
    from elastictrain.checkpoint.state.flat import Staging, load

    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(32 << 20, device="cuda") for i in range(4)}  # 512 MiB
    originals = {k: v.cpu() for k, v in state.items()}
    staging = Staging()
    staging.snapshot(state).wait()  # allocate and pin once, as the runner's first checkpoint does
    assert staging.buffer.is_pinned()

    # The floor: the same bytes copied into warm pinned memory, nothing else.
    dst = [torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for v in state.values()]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for d, v in zip(dst, state.values(), strict=True):
        d.copy_(v, non_blocking=True)
    torch.cuda.synchronize()
    copy_s = time.perf_counter() - t0

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    snap = staging.snapshot(state)
    issued_s = time.perf_counter() - t0
    # The training stream goes on at once: this in-place update is ordered after the copies.
    for v in state.values():
        v.add_(1.0)
    snap.wait()
    landed_s = time.perf_counter() - t0
    loaded = load(bytearray(snap.data))
    assert all(torch.equal(loaded[k], originals[k]) for k in state), "snapshot saw a later update"
    figure(
        "pinned-snapshot",
        bytes=sum(v.numel() * 4 for v in state.values()),
        copy_s=round(copy_s, 4),
        snapshot_call_s=round(issued_s, 4),
        snapshot_landed_s=round(landed_s, 4),
        landed_over_copy=round(landed_s / copy_s, 2),
    )
    assert landed_s <= 2 * copy_s + 0.05, (landed_s, copy_s)


def test_map_location_moves_checkpoints_between_cuda_and_cpu(tmp_path):
    from elastictrain import CheckpointManager, load_checkpoint

    torch.manual_seed(0)
    gpu_model = nn.Linear(64, 64).cuda()
    opt = torch.optim.Adam(gpu_model.parameters())
    gpu_model(torch.randn(8, 64, device="cuda")).sum().backward()
    opt.step()
    url = str(tmp_path / "from-cuda")
    ckpt = CheckpointManager(url, preempt_signals=())
    assert ckpt.resume(gpu_model, opt) == 0
    ckpt.save(1, gpu_model, opt, final=True)
    ckpt.close()
    on_cpu = load_checkpoint(url)  # CUDA -> CPU
    assert all(t.device.type == "cpu" for t in on_cpu["model"].values())
    assert all(torch.equal(on_cpu["model"][k], v.cpu()) for k, v in gpu_model.state_dict().items())

    cpu_model = nn.Linear(64, 64)
    cpu_opt = torch.optim.Adam(cpu_model.parameters())
    cpu_model(torch.randn(8, 64)).sum().backward()
    cpu_opt.step()
    url = str(tmp_path / "from-cpu")
    ckpt = CheckpointManager(url, preempt_signals=())
    ckpt.resume(cpu_model, cpu_opt)
    ckpt.save(1, cpu_model, cpu_opt, final=True)
    ckpt.close()
    target = nn.Linear(64, 64).cuda()
    target_opt = torch.optim.Adam(target.parameters())
    back = CheckpointManager(url, preempt_signals=(), map_location="cuda:0")  # CPU -> CUDA
    assert back.resume(target, target_opt) == 1
    back.close()
    for k, v in target.state_dict().items():
        assert v.is_cuda and torch.equal(v.cpu(), cpu_model.state_dict()[k])
    moments = target_opt.state_dict()["state"][0]["exp_avg"]
    assert moments.is_cuda and torch.equal(
        moments.cpu(), cpu_opt.state_dict()["state"][0]["exp_avg"]
    )


def test_bench_on_gpu_memory_beside_dcp_async_save(tmp_path):
    out = run_single(
        ["bench", "persist", "--device", "cuda", "--size", "1GB", "--repeats", "3", "--json",
         "--checkpoint-dir", str(tmp_path)],
        REPO_ROOT,
        600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert r["device"] == "cuda" or r["device"].startswith("cuda")
    figure(
        "bench-gpu",
        bytes=r["bytes"],
        copy_s=round(r["copy_s"], 4),
        elastictrain_blocked_s=round(r["elastictrain_blocked_s"], 4),
        dcp_async_blocked_s=r["dcp_async_blocked_s"] and round(r["dcp_async_blocked_s"], 4),
        elastictrain_blocked_over_copy=round(r["elastictrain_blocked_s"] / r["copy_s"], 2),
    )
    assert r["elastictrain_blocked_s"] > 0 and r["copy_s"] > 0


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
)
def test_model_parallel_example_spans_two_devices(launch, tmp_path):
    ckpt = str(tmp_path / "mp")
    args = ["--task", "examples.model_parallel.task:make_task", "--checkpoint-dir", ckpt]
    job = launch([*args, "--max-steps", "40", "--checkpoint-every-steps", "20"], nproc=1)
    assert job.wait(300) == 0, job.log()[-3000:]
    assert "on the CPU" not in job.log()
    assert final_state(ckpt)["progress"]["step"] == 40
    figure("model-parallel", devices=torch.cuda.device_count(), steps=40)


def _probe(launch, case: str, nproc: int) -> list[dict]:
    job = launch([case], nproc=nproc, name=case, entry=("-m", "tests.helpers.nccl_in_place_probe"))
    assert job.wait(300) == 0, job.log()[-4000:]
    return [
        json.loads(line.split("PROBE ", 1)[1])
        for line in job.log().splitlines()
        if "PROBE {" in line
    ]


def test_an_nccl_group_aborted_mid_collective_is_rebuilt_in_the_same_process(launch):
    """--replace-in-place on NCCL (epoch_end): a collective queued behind seconds of GPU work,
    the epoch's end announced in the job's store; the watch thread aborts the communicators, the
    collective's error reads as a peer's loss, NCCL's watchdog leaves the process alone
    (TORCH_NCCL_ASYNC_ERROR_HANDLING=0), and the next epoch's NCCL group is built in the same
    process and computes right. One GPU: a group of one rank (what one device can show)."""
    (got,) = _probe(launch, "abort", nproc=1)
    assert got["first_ok"] and got["rebuilt_ok"], got
    assert got["raised"] and got["peer_loss"], got
    assert got["abort_s"] < 5, got  # the watch hears the end in one store round trip
    figure("nccl-abort-and-rebuild", **got)


def test_cuda_state_moves_live_into_a_replacement_bitwise(launch):
    """A survivor's CUDA model and AdamW state, sent live to a replacement
    (``checkpoint.resume.live.fetch``) and mapped to its device: bitwise equal to the survivor's.
    Two ranks share cuda:0 over gloo (NCCL refuses two ranks on one device)."""
    got = _probe(launch, "live", nproc=2)
    assert len(got) == 2, got
    for rank in got:
        assert rank["device"] == "cuda:0" and rank["on_device"], rank
        assert rank["differed_before"] and rank["bitwise_equal"], rank
        assert rank["tier"] == "live", rank
    figure("cuda-state-live", bytes=got[0]["bytes"], bitwise_equal=True)
