"""``python -m elastictrain bench recovery --in-place``: in-place recovery beside restart-all on the
same job, 4 ranks as 2 simulated nodes of 2 (two torchrun agents on this host, a c10d rendezvous
hosted by node 0's agent; CPU/gloo).

In place (``--replace-in-place``), one job: each rank's training process SIGKILLed in turn (ranks
1, 2, 3, 0: both nodes, the writer last), each time kill -> the survivors' next completed step and
the world size it runs at; then node 1 SIGKILLed whole (its agent and every process under it) ->
the survivors' next step at the smaller world size. Restart-all, a second job of the same shape:
rank 1's worker SIGKILLed, then node 1, the same two figures. Every figure is read from the job's
event log (``first_step`` after the kill, against the kill's wall-clock time).

``--spares``: the node kill once more, in place with a spare node standing by (three simulated
nodes, ``--spare-nodes 1``): the spare's ranks take the lost node's places at the same world size.

``--parallel hsdp|fsdp``: the same job sharded (HSDP 2x2, a replica per node; FSDP over all 4
ranks), each node's memory tier in a folder of its own with a copy every 10 steps. Each figure
also says where the state came from (``live``: the survivors' memory; ``fast``: node memory's
copies, a rollback), the steps redone, and the bytes read from the durable tier.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import statistics
import sys
import time
from typing import Any

from elastictrain.bench.child import (
    Torchrun,
    child_env,
    events_in,
    first_step_after,
    toy_job_args,
    wait_for,
)
from elastictrain.observe.events import Event
from elastictrain.tools.chaos import descendants

KILLED_RANKS = (1, 2, 3, 0)
NPROC = 2  # ranks per simulated node
_RDZV_CONF = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"


def _node_command(
    node: int, port: int, run_id: str, args: list[str], nodes: str = "1:2"
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nodes}",
        f"--nproc_per_node={NPROC}",
        "--max-restarts=3",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf={_RDZV_CONF},is_host={1 if node == 0 else 0}",
        *args,
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _TwoNodes:
    """Two (``count``) torchrun agents of one job, each in a session of its own."""

    def __init__(self, workdir: str, name: str, args: list[str], count: int = 2) -> None:
        """``args``: the job's; ``{node}`` in one is the node's number (its own tier folder)."""
        port, run_id = _free_port(), f"{name}-{os.getpid()}"
        # A store of its own per attempt: the agents' shared one can hand a restarted group the
        # dead workers' addresses (docs/restarts.md); the two-node recipe sets it the same way.
        env = child_env(
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
            ELASTICTRAIN_LOG_LEVEL="INFO",
        )
        self.nodes = [
            Torchrun(
                [],
                os.path.join(workdir, f"{name}-node{n}.log"),
                env,
                command=_node_command(
                    n, port, run_id, [a.format(node=n) for a in args], f"{count - 1}:{count}"
                ),
            )
            for n in range(count)
        ]

    def log(self) -> str:
        return "".join(n.log() for n in self.nodes)

    def kill_node(self, node: int) -> None:
        """Node ``node`` lost: its agent and every process under it, SIGKILL, at once."""
        agent = self.nodes[node].proc.pid
        for pid in [agent, *descendants(agent)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


def _args(ckpt: str, ev: str, size: int, in_place: bool, parallel: str) -> list[str]:
    args = [*toy_job_args(ckpt, ev, size), "--parallel", parallel]
    if parallel != "ddp":
        # Each simulated node's memory tier in a folder of its own (one host holds both), a copy
        # every 10 steps: what an FSDP rollback goes back to.
        tier = os.path.join(os.path.dirname(ckpt), f"{os.path.basename(ckpt)}-tier-{{node}}")
        args += ["--local-checkpoint-dir", tier, "--local-every-steps", "10"]
    return [*args, *(["--replace-in-place"] if in_place else [])]


def _checkpoint_at_full_size(ev: str) -> bool:
    """Whether the job has committed a checkpoint at 2 x NPROC ranks (node 1's agent may join the
    rendezvous late: the job then starts on node 0 alone and grows)."""
    events = events_in(ev)
    starts = [i for i, e in enumerate(events) if e["event"] == Event.START]
    full = [i for i in starts if events[i]["world_size"] == 2 * NPROC]
    return bool(full) and any(e["event"] == Event.CHECKPOINT for e in events[full[-1] :])


def _first_step_after(ev: str, t: float, job: Torchrun) -> tuple[dict, dict, dict]:
    """The first step after wall-clock time ``t``, and the ``start`` and ``resume`` of its epoch."""
    first = first_step_after(ev, t, 180, "the next step", job)
    events = events_in(ev)
    start = [e for e in events if e["event"] == Event.START and e["time"] > t][-1]
    resume = [e for e in events if e["event"] == Event.RESUME and e["time"] >= start["time"]][0]
    return first, start, resume


def _copies_since_start(ev: str) -> int:
    """Node-memory copies committed since the last epoch began. Sharded, a kill waits for two: a
    rollback goes to the newest copy every node holds whole, and a copy's buddy transfer (the
    lost node's shards) is done once the next copy has begun; a kill before any would measure a
    rollback to the durable tier instead."""
    events = events_in(ev)
    last = max(i for i, e in enumerate(events) if e["event"] == Event.START)
    return sum(e["event"] == Event.LOCAL_CHECKPOINT for e in events[last:])


def _spares_ready(log: str, replaced: dict[int, int]) -> bool:
    """Whether every rank has a spare waiting: one more than it has had replacements."""
    return all(log.count(f"spare for rank {r} ready") > n for r, n in replaced.items())


def _figure(first: dict, start: dict, resume: dict, t_kill: float) -> dict[str, Any]:
    held = start.get("held_step")
    return {
        "kill_to_step_s": first["time"] - t_kill,
        "world_size": start["world_size"],
        "began": start.get("began", "restart through torchrun"),
        "restart_count": start["restart_count"],
        "held_step": held,
        "resumed_step": resume["step"],
        "tier": resume.get("tier"),
        "durable_bytes": resume.get("remote_bytes", 0),
        # The steps trained again: those since the step resumed at, the one in flight included
        # (in place the survivors say which they held; a restart does not know).
        "redone_steps": None if held is None else held - resume["step"] + 1,
        # Where the time went: the epoch's init (members, groups, agreement), the state (from
        # a survivor in place, from the checkpoints on a restart), the DDP wrap and the step.
        "init_s": start["init_s"],
        "load_s": first["resume_s"],
        "first_step_s": first["ddp_s"] + first["step_s"],
    }


def measure(
    workdir: str,
    size: int,
    in_place: bool,
    ranks: tuple[int, ...] = KILLED_RANKS,
    parallel: str = "ddp",
) -> dict[str, Any]:
    """``ranks``: whose training process is SIGKILLed in turn, in place (restart-all: rank 1).
    ``parallel``: the job's ``--parallel`` (hsdp: a replica per node, 2x2)."""
    name = f"{parallel}-{'in-place' if in_place else 'restart-all'}"
    ckpt, ev = os.path.join(workdir, f"ckpt-{name}"), os.path.join(workdir, f"{name}.jsonl")
    job = _TwoNodes(workdir, name, _args(ckpt, ev, size, in_place, parallel))
    watch = job.nodes[0]
    try:
        wait_for(lambda: _checkpoint_at_full_size(ev), 240, "a checkpoint at 4 ranks", watch)
        kills, replaced = [], dict.fromkeys(range(2 * NPROC), 0)
        for rank in ranks if in_place else (1,):
            if in_place:
                # Every rank's spare ready (imported and built), the last replacement's new one
                # too: a kill while spares still import measures this host's 2 cores, not the
                # recovery (and a kill before the rank's own spare is ready is another case).
                wait_for(lambda: _spares_ready(job.log(), replaced), 180, "the spares", watch)
                if parallel != "ddp":
                    wait_for(lambda: _copies_since_start(ev) >= 2, 180, "two copies", watch)
                    time.sleep(0.5)  # between two copies, not at one: a rollback's real cost
                replaced[rank] += 1
                starts = [e for e in events_in(ev) if e["event"] == Event.START]
                pid = starts[-1]["processes"][rank][1]  # the training process, not its supervisor
            else:
                pid = next(n.workers()[rank] for n in job.nodes if rank in n.workers())
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)
            kills.append(_figure(*_first_step_after(ev, t_kill, watch), t_kill))
        time.sleep(1.0)  # a few steps at full size, so the node kill is its own event
        if parallel != "ddp":
            wait_for(lambda: _copies_since_start(ev) >= 2, 180, "two copies", watch)
        t_kill = time.time()
        job.kill_node(1)
        node = _figure(*_first_step_after(ev, t_kill, watch), t_kill)
    finally:
        job.stop()
    return {
        "rank_kills": kills,
        "median_kill_to_step_s": statistics.median(k["kill_to_step_s"] for k in kills),
        "node_kill": node,
    }


def measure_spare(workdir: str, size: int, parallel: str = "ddp") -> dict[str, Any]:
    """The node kill again, with a spare node standing by (``--spare-nodes 1``): three simulated
    nodes of ``NPROC``, two training. The node killed is a training one that does not host the
    rendezvous store (node 0's agent does); its ranks' places go to the spare's."""
    name = f"{parallel}-spare"
    ckpt, ev = os.path.join(workdir, f"ckpt-{name}"), os.path.join(workdir, f"{name}.jsonl")
    args = [*_args(ckpt, ev, size, True, parallel), "--spare-nodes", "1"]
    job = _TwoNodes(workdir, name, [*args, "--max-replacements", "0"], count=3)
    watch = job.nodes[0]
    try:
        wait_for(lambda: _checkpoint_at_full_size(ev), 240, "a checkpoint at 4 ranks", watch)
        if parallel != "ddp":
            wait_for(lambda: _copies_since_start(ev) >= 2, 180, "two copies", watch)
        time.sleep(1.0)
        training = [n for n in (1, 2) if min(job.nodes[n].workers(), default=99) < 2 * NPROC]
        t_kill = time.time()
        job.kill_node(training[0])
        first, start, resume = _first_step_after(ev, t_kill, watch)
    finally:
        job.stop()
    return {**_figure(first, start, resume, t_kill), "took_over": start.get("took_over")}


def run(workdir: str, size: int, parallel: str = "ddp", spares: bool = False) -> dict[str, Any]:
    return {
        "parallel": parallel,
        "in_place": measure(workdir, size, True, parallel=parallel),
        "restart_all": measure(workdir, size, False, parallel=parallel),
        **({"spare": measure_spare(workdir, size, parallel)} if spares else {}),
    }


def table(r: dict[str, Any]) -> str:
    ip, ra = r["in_place"], r["restart_all"]
    lines = [
        f"--parallel {r.get('parallel', 'ddp')}, 4 ranks as 2 simulated nodes of 2 (CPU/gloo), "
        "the same job in both modes:",
        f"| {'SIGKILL':<34} | {'in place':>24} | {'restart-all':>24} |",
        f"|{'-' * 36}|{'-' * 26}|{'-' * 26}|",
    ]

    def cell(k: dict) -> str:
        return f"{k['kill_to_step_s']:.3f} s at W={k['world_size']}"

    for i, k in enumerate(ip["rank_kills"]):
        other = cell(ra["rank_kills"][i]) if i < len(ra["rank_kills"]) else ""
        lines.append(f"| {'a training process (one rank)':<34} | {cell(k):>24} | {other:>24} |")
    lines.append(
        f"| {'  median':<34} | {ip['median_kill_to_step_s']:>22.3f} s | "
        f"{ra['median_kill_to_step_s']:>22.3f} s |"
    )
    lines.append(
        f"| {'a node (2 ranks)':<34} | {cell(ip['node_kill']):>24} | {cell(ra['node_kill']):>24} |"
    )
    if "spare" in r:
        spare = r["spare"]
        lines.append(f"| {'a node, a spare node standing by':<34} | {cell(spare):>24} | {'':>24} |")
    parts = ", ".join(
        f"{what} {statistics.median(k[key] for k in ip['rank_kills']):.3f} s"
        for what, key in (
            ("epoch init", "init_s"),
            ("the state (survivors' or node memory)", "load_s"),
            ("wrap + first step", "first_step_s"),
        )
    )
    lines.append(f"in place, a rank's kill (medians): {parts}")
    every = [*ip["rank_kills"], ip["node_kill"], *([r["spare"]] if "spare" in r else [])]
    lines.append(
        f"in place: torchrun restarts {max(k['restart_count'] for k in every)}; resumed from "
        f"{', '.join(sorted({k['tier'] for k in every}))}; steps redone per recovery "
        f"{[k['redone_steps'] for k in every]} (1: only the step in flight); bytes read from "
        f"the durable tier {sum(k['durable_bytes'] for k in every)}"
    )
    return "\n".join(lines)
