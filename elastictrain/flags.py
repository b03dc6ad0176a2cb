"""The runner's command line, built from the config's fields: a flag per field, its type, choices
and default from the annotation and the value, its help from the field's docstring.

``python -m elastictrain.flags`` prints the flags as the Markdown table in ``docs/cli.md`` (a test
checks the file against this).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import types
import typing
from dataclasses import fields
from typing import Any, Literal, get_args, get_origin, get_type_hints

from elastictrain.config import CheckpointConfig, RunConfig, flag, settings
from storage.urls import parse_option

# (title, config class) in --help order; the runner's defaults come from RunConfig().
GROUPS = (("training", RunConfig), ("checkpoints", CheckpointConfig))


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string right below it), whitespace collapsed."""
    import ast

    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        doc = (
            nxt.value.value
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
            else None
        )
        if isinstance(node, ast.AnnAssign) and isinstance(doc, str):
            docs[node.target.id] = " ".join(doc.split())
    return docs


def option(name: str, kind: Any) -> str:
    """The flag of a field: a repeatable one is the singular (``--storage-option``)."""
    repeatable = get_origin(kind) in (dict, tuple, list)
    return flag(name[:-1] if repeatable and name.endswith("s") else name)


def shown(value: Any) -> str:
    """A default as ``--help`` and docs/cli.md show it."""
    if value is None or value is False:
        return "off"
    if value is True:
        return "on"
    if isinstance(value, (list, tuple, dict)):
        return ", ".join(value) or "none"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value


def _storage_option(text: str) -> tuple[str, object]:
    try:
        return parse_option(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _count_or_word(text: str) -> int | str:
    return int(text) if text.isdigit() else text


def _argument(kind: Any) -> dict[str, Any]:
    """argparse's keywords for a field of type ``kind``."""
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    origin, args = get_origin(kind), get_args(kind)
    if origin is dict:  # KEY=VALUE, repeatable; fsspec's values may be booleans or JSON
        return {"action": "append", "type": _key_value if args[1] is str else _storage_option}
    if origin in (tuple, list):
        return {"action": "append"}
    if origin is Literal:
        return {"choices": list(args)}
    if origin in (typing.Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        if any(get_origin(a) is Literal for a in kinds):  # a count or a word ("auto")
            return {"type": _count_or_word}
        return _argument(kinds[0])
    return {"type": kind}


def build_parser() -> argparse.ArgumentParser:
    from elastictrain.tools import TOOLS

    p = argparse.ArgumentParser(
        prog="torchrun ... -m elastictrain",
        description="Fault-tolerant elastic training. Without torchrun, 'python -m elastictrain "
        "COMMAND' runs a tool: "
        + "; ".join(f"{name}: {what}" for name, (_, what) in TOOLS.items())
        + ".",
    )
    runner = RunConfig()
    for title, cls in GROUPS:
        group = p.add_argument_group(title)
        defaults = runner if cls is RunConfig else runner.checkpoint
        kinds, docs = get_type_hints(cls), field_docs(cls)
        for f in fields(cls):
            if f.name not in settings(cls):
                continue
            kw = _argument(kinds[f.name])
            default = getattr(defaults, f.name)
            # argparse appends to a list default: repeatable flags start empty, and an unset one
            # falls back to the config's default.
            kw["default"] = None if kw.get("action") == "append" else default
            kw["help"] = f"{docs[f.name].replace('%', '%%')} (default: {shown(default)})"
            group.add_argument(
                option(f.name, kinds[f.name]), dest=f.name, metavar=f.metadata.get("metavar"), **kw
            )
    return p


def parse_args(argv: list[str]) -> RunConfig:
    values = {k: v for k, v in vars(build_parser().parse_args(argv)).items() if v is not None}
    for name in ("task_options", "storage_options"):
        if name in values:
            values[name] = dict(values[name])
    if "preempt_signals" in values:
        values["preempt_signals"] = tuple(values["preempt_signals"])
    checkpoint = {k: values.pop(k) for k in settings(CheckpointConfig) if k in values}
    checkpoint.setdefault("checkpoint_every_steps", RunConfig().checkpoint.checkpoint_every_steps)
    return RunConfig(**values, checkpoint=CheckpointConfig(**checkpoint, spell=flag))


def markdown() -> str:
    """The flags as docs/cli.md lists them: one table per group."""
    runner, out = RunConfig(), []
    for title, cls in GROUPS:
        defaults = runner if cls is RunConfig else runner.checkpoint
        kinds, docs = get_type_hints(cls), field_docs(cls)
        out += [
            f"### {title.capitalize()}",
            "",
            "| flag | default | what it does |",
            "|---|---|---|",
        ]
        for name in settings(cls):
            spelled = f"`{option(name, kinds[name])}`"
            if kinds[name] is bool:
                spelled += f", `--no-{option(name, bool)[2:]}`"
            out.append(f"| {spelled} | `{shown(getattr(defaults, name))}` | {docs[name]} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(markdown(), end="")
