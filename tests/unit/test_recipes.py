"""The launch recipes (SLURM, plain hosts, Kubernetes) are valid: shell syntax, YAML, and every
torchrun and elastictrain flag they use exists. They need a cluster to run; this is what CI can check."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import yaml

from elastictrain.config import parse_args
from tests.helpers.launcher import REPO_ROOT

SHELL_RECIPES = ["examples/slurm/train.sbatch", "examples/multinode.sh", "examples/two_nodes.sh"]
STUB_ENV = {
    "SLURM_JOB_NAME": "j",
    "SLURM_JOB_ID": "1",
    "SLURM_NNODES": "4",
    "HEAD": "h",
    "PATH": os.environ["PATH"],
}


def _torchrun_options() -> set[str]:
    from torch.distributed.run import get_args_parser

    return set(get_args_parser()._option_string_actions)


def _check_torchrun_flags(text: str) -> None:
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    end = code.index("-m elastictrain")
    command = code[code.rindex("torchrun", 0, end) : end]
    used = {m.split("=")[0] for m in re.findall(r"--[a-z_-]+(?:=)?", command)}
    unknown = used - _torchrun_options()
    assert not unknown, f"torchrun has no {sorted(unknown)}"


@pytest.mark.parametrize("recipe", SHELL_RECIPES)
def test_shell_recipe_is_valid(recipe):
    path = os.path.join(REPO_ROOT, recipe)
    subprocess.run(["bash", "-n", path], check=True)
    with open(path) as f:
        text = f.read()
    _check_torchrun_flags(text)
    assert "Elastic and timeout settings" in text or recipe.endswith("two_nodes.sh")
    if "ET_ARGS=(" in text:
        block = text[text.index("ET_ARGS=(") : text.index("\n)\n", text.index("ET_ARGS=(")) + 2]
        out = subprocess.run(
            ["bash", "-c", f'{block}\nprintf "%s\\n" "${{ET_ARGS[@]}}"'],
            env=STUB_ENV,
            capture_output=True,
            text=True,
            check=True,
        )
        parse_args(out.stdout.splitlines())  # raises on a flag or value elastictrain rejects


def test_kubernetes_manifest_is_valid():
    path = os.path.join(REPO_ROOT, "examples/kubernetes/pytorchjob.yaml")
    with open(path) as f:
        job = yaml.safe_load(f)
    assert job["kind"] == "PyTorchJob"
    policy = job["spec"]["elasticPolicy"]
    assert policy["rdzvBackend"] == "c10d" and policy["minReplicas"] <= policy["maxReplicas"]
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    args = container["args"]
    _check_torchrun_flags(
        " ".join(["torchrun", *args]).replace("-m elastictrain", "-m elastictrain")
    )
    cfg = parse_args(args[args.index("elastictrain") + 1 :])
    assert cfg.checkpoint_dir.startswith("s3://")  # pods come and go: never a pod's disk
