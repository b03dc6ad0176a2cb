"""The manual matches the code: flags, events and errors are documented where the README says, and
the README stays a short manual."""

from __future__ import annotations

import pathlib
import re

from elastictrain.flags import build_parser, markdown
from tests.helpers.paths import REPO_ROOT

ROOT = pathlib.Path(REPO_ROOT)
MANUAL = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def _read(relative: str) -> str:
    return (ROOT / relative).read_text()


def test_the_cli_doc_is_the_generated_flag_table_and_lists_every_flag_of_help():
    """docs/cli.md's tables are what ``python -m elastictrain.flags`` prints from the config's
    fields; a flag added, renamed or re-documented without regenerating it fails here."""
    doc = _read("docs/cli.md")
    start = doc.index("-->\n", doc.index("<!-- flags:")) + len("-->\n")
    generated = doc[start : doc.index("<!-- end of flags -->")].strip()
    assert generated == markdown().strip(), "regenerate: python -m elastictrain.flags"
    help_text = build_parser().format_help()
    for action in build_parser()._actions:
        for option in action.option_strings:
            if option.startswith("--") and option != "--help":
                assert f"`{option}`" in generated, f"docs/cli.md lacks {option}"
                assert option in help_text


def test_the_flag_table_shows_each_flags_real_default():
    """Each row's default is the value a run with no flags gets (parsed, not restated)."""
    from elastictrain.flags import parse_args, shown

    cfg = parse_args([])
    rows = dict(re.findall(r"^\| `(--[a-z-]+)`[^|]* \| `([^`]*)` \|", _read("docs/cli.md"), re.M))
    for action in build_parser()._actions:
        if action.dest == "help":
            continue
        owner = cfg if hasattr(cfg, action.dest) else cfg.checkpoint
        option = next(o for o in action.option_strings if not o.startswith("--no-"))
        assert rows[option] == shown(getattr(owner, action.dest)), option


def test_the_event_doc_lists_every_event_and_cause():
    """The event log's names are an enum; docs/events.md's table names each one, and nothing else,
    and the exit event's documented causes are the Cause enum's."""
    from elastictrain.observe.events import Cause, Event

    doc = _read("docs/events.md")
    table = doc[: doc.index("## Run report")]
    rows = dict(re.findall(r"^\| `([a-z_]+)` \| (.*) \|$", table, re.M))
    assert set(rows) == {e.value for e in Event}, set(rows) ^ {e.value for e in Event}
    for cause in Cause:
        assert f"`{cause.value}`" in rows[Event.EXIT], f"docs/events.md's exit row lacks {cause}"


def test_every_error_the_manual_names_is_importable_from_errors_with_its_exit_code():
    import elastictrain.errors as errors

    named = set()
    for path in MANUAL:
        named |= set(re.findall(r"\b([A-Z][A-Za-z]+Error)\b", path.read_text()))
    named -= {"KeyboardInterrupt", "RuntimeError", "ValueError", "TimeoutError", "OSError"}
    named -= {"DistBackendError", "SignalException"}  # torch's, seen in logs: not ours to raise
    named -= {"InternalError"}  # an S3 error code the retry layer knows
    missing = sorted(n for n in named if not hasattr(errors, n))
    assert not missing, f"named in the manual but not in elastictrain.errors: {missing}"
    codes = _read("docs/troubleshooting.md")
    for name in errors.__all__:
        code = errors.exit_code(getattr(errors, name))
        assert re.search(rf"^\| {code} \|", codes, re.M), f"{name}: exit {code} undocumented"


def test_the_exit_code_table_is_generated_from_errors_py():
    """docs/troubleshooting.md's exit codes are what ``python -m elastictrain.errors`` prints:
    a code, an error or an exit code moved without regenerating the table fails here."""
    from elastictrain import errors

    doc = _read("docs/troubleshooting.md")
    start = doc.index("-->\n", doc.index("<!-- exit codes:")) + len("-->\n")
    generated = doc[start : doc.index("<!-- end of exit codes -->")].strip()
    assert generated == errors.markdown().strip(), "regenerate: python -m elastictrain.errors"
    constants = {v for k, v in vars(errors).items() if k.startswith("EXIT_") and k != "EXIT_CODES"}
    assert constants <= set(errors.EXIT_CODES), constants - set(errors.EXIT_CODES)


def test_the_top_level_exports_what_a_user_calls_and_old_error_imports_still_work():
    import warnings

    import elastictrain

    assert set(elastictrain.__all__) == {
        "CheckpointManager", "Preempted", "Task", "__version__", "eval_shard",
        "init_distributed", "load_checkpoint",
    }  # fmt: skip
    for name in elastictrain.__all__:
        assert getattr(elastictrain, name) is not None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from elastictrain import ConfigError  # noqa: F401  (a release ago it lived here)
    assert "import it from elastictrain.errors" in str(caught[0].message)


def test_the_readme_is_a_short_manual_and_every_link_in_the_manual_resolves():
    readme = _read("README.md")
    assert len(readme.splitlines()) <= 350
    for path in MANUAL:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" in target:
                continue
            assert (path.parent / target).exists(), f"{path.name} links to a missing {target}"
