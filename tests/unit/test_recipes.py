"""The launch recipes (SLURM, plain hosts, Kubernetes) are valid: shell syntax, YAML, and every
torchrun and elastictrain flag they use exists. They need a cluster to run; this is what CI can check."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import yaml

from elastictrain.flags import parse_args
from tests.helpers.launcher import REPO_ROOT

SHELL_RECIPES = ["examples/slurm/train.sbatch", "examples/multinode.sh", "examples/two_nodes.sh"]
STUB_ENV = {
    "SLURM_JOB_NAME": "j",
    "SLURM_JOB_ID": "1",
    "SLURM_NNODES": "4",
    "HEAD": "h",
    "CHECKPOINT_DIR": "s3://b/r",
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
    assert cfg.checkpoint.checkpoint_dir.startswith("s3://")  # pods come and go: never a pod's disk


_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*")
MULTINODE_SNIPPETS = {  # docs/multinode.md's code blocks: the first line of each names it
    "examples/multinode.sh": "# Plain hosts (examples/multinode.sh)",
    "examples/slurm/train.sbatch": "# SLURM (examples/slurm/train.sbatch)",
    "examples/kubernetes/pytorchjob.yaml": "# Kubernetes (examples/kubernetes/pytorchjob.yaml)",
}


def _code_flags(text: str) -> set[str]:
    """Every --flag outside comments (#SBATCH lines are comments too)."""
    code = [line.split(" #")[0] for line in text.splitlines() if not line.lstrip().startswith("#")]
    return set(_FLAG.findall("\n".join(code)))


def _doc_block(first_line: str) -> str:
    with open(os.path.join(REPO_ROOT, "docs", "multinode.md")) as f:
        doc = f.read()
    start = doc.index(first_line)
    return doc[start : doc.index("```", start)]


@pytest.mark.parametrize("recipe", list(MULTINODE_SNIPPETS))
def test_multinode_doc_snippets_use_the_recipes_flags(recipe):
    """docs/multinode.md's snippets are the recipes, line for line in their flags: a flag
    added to or dropped from either side fails here."""
    with open(os.path.join(REPO_ROOT, recipe)) as f:
        text = f.read()
    if recipe.endswith(".yaml"):
        (container,) = yaml.safe_load(text)["spec"]["pytorchReplicaSpecs"]["Worker"]["template"][
            "spec"
        ]["containers"]
        text = " ".join(["torchrun", *container["args"]])
    snippet = _code_flags(_doc_block(MULTINODE_SNIPPETS[recipe]))
    assert snippet == _code_flags(text), (
        f"docs/multinode.md only: {sorted(snippet - _code_flags(text))}; "
        f"{recipe} only: {sorted(_code_flags(text) - snippet)}"
    )
