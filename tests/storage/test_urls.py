from __future__ import annotations

import os

import pytest

from storage import StorageConfigError, open_store, redact_options, redact_url
from storage.retention import partial_steps_to_delete, steps_to_delete
from storage.urls import open_url


def test_relative_path_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, root = open_url("./checkpoints")
    assert root == os.path.join(str(tmp_path), "checkpoints")


def test_unknown_protocol_is_clear():
    with pytest.raises(StorageConfigError, match="nosuchproto"):
        open_store("nosuchproto://bucket/x")


def test_error_does_not_leak_credentials_in_url():
    with pytest.raises(StorageConfigError) as info:
        open_store("nosuchproto://admin:hunter2@bucket/x")
    assert "hunter2" not in str(info.value)
    assert "***@bucket" in str(info.value)


def test_redaction():
    assert redact_url("s3://AKIA:verysecret@bucket/x") == "s3://***@bucket/x"
    safe = redact_options({"key": "AKIA", "secret": "s", "endpoint_url": "http://h"})
    assert safe == {"key": "***", "secret": "***", "endpoint_url": "http://h"}


def test_retention_policy():
    assert steps_to_delete([1, 2, 3, 4], keep_last=2, newest_good=4) == [1, 2]
    assert steps_to_delete([1, 2, 3, 4], keep_last=1, newest_good=3) == [1, 2]
    with pytest.raises(ValueError, match="keep_last"):
        steps_to_delete([1], keep_last=0, newest_good=1)
    assert partial_steps_to_delete([0, 1, 5, 9], committed_steps=[1, 5], newest_good=5) == [0]
    assert partial_steps_to_delete([0, 9], committed_steps=[], newest_good=0) == []


def test_partial_cleanup_stops_at_the_newest_good_step_not_the_newest_manifest():
    """A manifest above the run's progress (a stale generation's late commit at 100, or a corrupt
    newest step) must not put the steps the run is writing now (70) below the threshold: only
    what is older than the step just committed and verified (60) is a dead writer's leftover."""
    dirs, committed = [30, 55, 60, 70, 100], [30, 60, 100]
    assert partial_steps_to_delete(dirs, committed, newest_good=60) == [55]


@pytest.mark.parametrize(
    "name", ["../escape.pt", "/etc/passwd", "s3://other/x", "a/b.pt", "..", "", ".hidden"]
)
def test_manifest_file_names_cannot_escape(tmp_path, name):
    import json

    from storage import CheckpointCorruptError
    from storage.manifest import FORMAT_VERSION, Manifest

    doc = {
        "format_version": FORMAT_VERSION,
        "step": 1,
        "created_at": 0.0,
        "metadata": {},
        "files": {name: {"size": 1, "sha256": "00"}},
    }
    with pytest.raises(CheckpointCorruptError, match="unsafe payload file name"):
        Manifest.from_json(json.dumps(doc).encode(), where="test")
    with pytest.raises(ValueError, match="unsafe payload file name"):
        open_store(str(tmp_path)).commit(1, {name: b"x"}, {})


def test_a_newer_format_is_refused_not_corrupt_and_a_garbled_version_is_corrupt(tmp_path):
    import json

    from storage import CheckpointCorruptError, NewerFormatError
    from storage.manifest import FORMAT_VERSION

    store = open_store(str(tmp_path))
    store.commit(1, {"s.bin": b"x"}, {})
    path = tmp_path / "step-000000000001" / "manifest.json"
    doc = json.loads(path.read_text())
    for version, error in ((FORMAT_VERSION + 1, NewerFormatError), ("1", CheckpointCorruptError)):
        path.write_text(json.dumps({**doc, "format_version": version}))
        with pytest.raises(error):
            store.read_manifest(1)
    path.write_text(json.dumps({**doc, "format_version": FORMAT_VERSION + 1}))
    seen = []
    with pytest.raises(NewerFormatError):  # listing does not report it as corrupt and go on
        store.ranked_manifests(on_corrupt=lambda step, e: seen.append(step))
    assert seen == []


def test_storage_option_values():
    from storage import StorageConfigError, parse_option

    assert parse_option("endpoint_url=http://h:1/x=y") == ("endpoint_url", "http://h:1/x=y")
    assert parse_option("anon=false") == ("anon", False)  # the string "false" would be truthy
    assert parse_option('config_kwargs={"retries": {"total_max_attempts": 3}}') == (
        "config_kwargs",
        {"retries": {"total_max_attempts": 3}},
    )
    with pytest.raises(StorageConfigError, match="KEY=VALUE"):
        parse_option("no-equals-sign")
    with pytest.raises(StorageConfigError, match="does not parse") as info:
        parse_option("secret={not json")
    assert "not json" not in str(info.value)  # a secret-looking option's value is never echoed
