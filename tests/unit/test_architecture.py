"""The tree's promises: no import cycles, a torch-free storage layer, tools that stay light."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO_ROOT

PACKAGES = ("elastictrain", "storage")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {
        _module_name(p): p
        for pkg in PACKAGES
        for p in sorted(pathlib.Path(REPO_ROOT, pkg).rglob("*.py"))
    }


def import_graph() -> dict[str, set[str]]:
    """Every import of one project module by another, wherever it sits in the file (module level,
    inside a function, under TYPE_CHECKING): a lazy import is still a dependency."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - node.level + 1]
                        + ([base] if base else [])
                    )
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                # the longest project module the target names (``pkg.mod.attr`` -> ``pkg.mod``)
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_detects_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    graph = import_graph()
    assert "elastictrain.observe.events" in graph["elastictrain.observe.timeline"]  # sees edges
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_storage_never_imports_elastictrain():
    graph = import_graph()
    bad = {
        m: sorted(d)
        for m, d in graph.items()
        if m.startswith("storage") and any(x.startswith("elastictrain") for x in d)
    }
    assert not bad, f"storage/ must stand alone: {bad}"


LAYERS = {
    # package: what it must never import (a lower layer knows nothing of a higher one)
    "elastictrain.cluster": (
        "elastictrain.checkpoint",
        "elastictrain.inplace",
        "elastictrain.train",
        "elastictrain.library",
    ),
    "elastictrain.checkpoint": (
        "elastictrain.inplace",
        "elastictrain.train",
        "elastictrain.library",
    ),
    "elastictrain.inplace": ("elastictrain.train", "elastictrain.library"),
    "elastictrain.runtime": (
        "elastictrain.checkpoint",
        "elastictrain.inplace",
        "elastictrain.train",
    ),
}


def test_each_layer_imports_only_those_below_it():
    """``checkpoint`` depended on the whole in-place machinery (``CheckpointManager.run`` owned a
    recovering loop); now it imports neither ``inplace`` nor ``train``, and ``cluster`` nothing
    above it. A lazy or TYPE_CHECKING import counts: it is still a dependency."""
    graph = import_graph()
    assert graph["elastictrain.checkpoint.resume.live"]  # sees edges
    bad = sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        for layer, banned in LAYERS.items()
        if m == layer or m.startswith(layer + ".")
        for d in deps
        if d.startswith(banned)
    )
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


MODULE_STATE = {
    "elastictrain.library._driver": "the process's one epoch driver: init_distributed returns a "
    "device, and the CheckpointManager built later finds the epoch through it",
    "elastictrain.mesh._current": "the data-parallel coordinates the public eval_shard(size) "
    "reads; the runner sets them each epoch",
    "elastictrain.cluster.groups._built_on_a_fresh_store": "a fact of the process: its default "
    "group was built on a fresh store (the restart-unsafe warning reads it)",
    "elastictrain.checkpoint.manager._warned_restart_unsafe": "a warning said once per process",
    "elastictrain.observe.terminal.STATUS": "the process's one terminal status line",
    "elastictrain.observe.logs.CONTEXT": "the rank and step every log line carries",
    "elastictrain.bench.throttled_fs._link_free_at": "the bench's simulated link, shared by every "
    "file the process opens on it",
    "elastictrain.bench.throttled_fs._lock": "guards it",
    "elastictrain.bench.throttled_fs._inside": "which thread is inside it",
    "elastictrain.bench.throttled_fs.REQUESTS": "what the bench counts on it",
    "elastictrain.bench.throttled_fs.BYTES": "what the bench counts on it",
}
"""Module-level state that changes while a process runs, each with why it is the process's and
not an epoch's (an epoch's lives in ``inplace.driver.Epoch``)."""

_CONSTANT_CALLS = {
    "TypeVar",
    "frozenset",
    "compile",
    "timedelta",
    "Path",
    "getLogger",
    "Struct",
    "namedtuple",
    "tuple",
    "field",
    "MappingProxyType",
    "Event",
}


def _module_state(name: str, path: pathlib.Path) -> set[str]:
    """Names ``path`` rebinds with ``global``, or binds at module level to something mutable: a
    container that is not an UPPER_CASE table, a lock, a thread-local, a class's instance."""
    tree = ast.parse(path.read_text())
    found = {f"{name}.{g}" for n in ast.walk(tree) if isinstance(n, ast.Global) for g in n.names}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for t in (t for t in targets if isinstance(t, ast.Name) and t.id != "__all__"):
            table = t.id.lstrip("_").isupper()
            container = isinstance(value, (ast.Dict, ast.List, ast.Set))
            call = value.func if isinstance(value, ast.Call) else None
            callee = getattr(call, "id", None) or getattr(call, "attr", "")
            instance = bool(callee) and callee.lstrip("_")[:1].isupper()
            if (
                (container and not table)
                or callee in ("Lock", "RLock", "local")
                or (instance and callee not in _CONSTANT_CALLS)
            ):
                found.add(f"{name}.{t.id}")
    return found


def test_no_module_level_mutable_state_outside_the_allow_list():
    """An epoch's state in a module global (``library._epoch``, ``epoch_end._current``) outlived
    its epoch and was read by the next one's threads. The driver holds it now; what is left at
    module level is named in :data:`MODULE_STATE` with its reason."""
    found = set()
    for name, path in _modules().items():
        found |= _module_state(name, path)
    assert "elastictrain.library._driver" in found  # the scan sees a global
    unlisted = sorted(found - set(MODULE_STATE))
    assert not unlisted, f"module-level state outside MODULE_STATE (give a reason): {unlisted}"
    assert not set(MODULE_STATE) - found, "MODULE_STATE names state that is gone: drop it"


def test_elastictrain_variables_are_read_in_knobs_alone():
    """``ELASTICTRAIN_AGENT_PID`` and the supervisor's role were read outside ``knobs``: a knob
    nobody can find. A variable's name appears as a string in ``knobs`` only (a message that
    names one for the user is a longer string)."""
    outside = sorted(
        f"{name}: {node.value}"
        for name, path in _modules().items()
        if name != "elastictrain.knobs"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and re.fullmatch(r"ELASTICTRAIN_[A-Z0-9_]+", node.value)
    )
    assert not outside, f"read ELASTICTRAIN_* through elastictrain.knobs: {outside}"


def _torch_loaded_after(code: str) -> bool:
    probe = (
        code
        + "\nimport sys\nprint(any(m == 'torch' or m.startswith('torch.') for m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1] == "True"


def test_storage_imports_no_torch():
    assert not _torch_loaded_after("import storage, storage.store, storage.retry, storage.hashing")
    assert _torch_loaded_after("import torch")  # the probe itself can see torch


@pytest.mark.parametrize("command", ["ls", "verify", "prune"])
def test_storage_cli_commands_import_no_torch(command, tmp_path):
    url = str(tmp_path / "ckpt")
    extra = ", '--keep-last', '1'" if command == "prune" else ""
    code = (
        f"from elastictrain.__main__ import main\nassert main([{command!r}, {url!r}{extra}]) == 0"
    )
    assert not _torch_loaded_after(code)


MAX_LINES = 400


def test_no_file_grows_past_what_a_reader_can_hold():
    """Every Python file of the project, tests and examples included, stays under 400 lines: past
    that a module holds more than one concern, and should be split along it."""
    long = {
        str(p.relative_to(REPO_ROOT)): n
        for top in (*PACKAGES, "tests", "examples")
        for p in pathlib.Path(REPO_ROOT, top).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_no_file_fits_under_the_limit_only_by_skipping_the_formatter():
    """``# fmt: skip`` packs lines; the line limit is about concerns, so each file, formatted as
    if it had none, must still fit."""
    ruff = pytest.importorskip("ruff")
    binary = ruff.find_ruff_bin()
    packed = {}
    for top in (*PACKAGES, "tests", "examples"):
        for p in pathlib.Path(REPO_ROOT, top).rglob("*.py"):
            text = p.read_text()
            if "fmt: skip" not in text:
                continue
            unskipped = re.sub(r"\s*# fmt: skip$", "", text, flags=re.M)
            out = subprocess.run(
                [binary, "format", "--stdin-filename", str(p), "-"],
                input=unskipped, capture_output=True, text=True, cwd=REPO_ROOT, check=True,
            )  # fmt: skip
            if (n := len(out.stdout.splitlines())) > MAX_LINES:
                packed[str(p.relative_to(REPO_ROOT))] = n
    assert not packed, f"over {MAX_LINES} lines once formatted: {packed}"


def _code_map() -> str:
    text = pathlib.Path(REPO_ROOT, "CONTRIBUTING.md").read_text()
    return text.split("## The code", 1)[1].split("\n## ", 1)[0]


def test_the_code_map_names_every_module_and_package():
    """CONTRIBUTING's code map is how a new maintainer finds a concern: a module it does not name
    is one nobody will find. Every module's name and every package's ``name/`` appear in it."""
    code_map = _code_map()
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*/?", code_map))
    missing = []
    for path in _modules().values():
        if path.name == "__init__.py":
            if f"{path.parent.name}/" not in words:
                missing.append(f"{path.parent.relative_to(REPO_ROOT)}/")
        elif path.stem not in {w.rstrip("/") for w in words} and path.stem != "__main__":
            missing.append(str(path.relative_to(REPO_ROOT)))
    assert not missing, f"CONTRIBUTING.md's code map does not name: {missing}"


def test_no_module_imports_another_modules_private_name():
    """A leading underscore is a module's own business: another module that imports it couples
    to what its owner may change without notice. Make the name public where it is shared."""
    found = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES:
                private = [
                    a.name
                    for a in node.names
                    if a.name.startswith("_") and not a.name.endswith("__")
                ]
                found += [f"{name} imports {node.module}.{p}" for p in private]
    assert not found, found


def test_the_checkpoint_package_exports_its_surface_and_importing_it_costs_no_torch():
    code = (
        "import sys, elastictrain.checkpoint as c\n"
        "assert 'torch' not in sys.modules, 'importing the package imported torch'\n"
        "assert all(getattr(c, name) is not None for name in c.__all__)\n"
        "assert c.Tier.FAST == 'fast' and c.CheckpointManager.__module__.endswith('manager')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
