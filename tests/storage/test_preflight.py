"""The startup probe names the cause of an unusable location, against an S3 endpoint that checks
credentials and permissions (moto with IAM auth on)."""

from __future__ import annotations

import errno

import pytest

import storage
from storage.local import LocalBackend


def _probe(url: str, **options) -> storage.StorageNotUsableError:
    store = storage.open_store(url, storage_options=options)
    with pytest.raises(storage.StorageNotUsableError) as info:
        store.probe(deadline_s=2)
    return info.value


def test_probe_passes_with_good_credentials(s3_auth):
    storage.open_store(
        f"s3://{s3_auth.bucket}/ok",
        storage_options={"endpoint_url": s3_auth.endpoint, **s3_auth.read_write},
    ).probe()


def test_unknown_access_key_is_named_and_the_secret_is_not(s3_auth):
    err = _probe(
        f"s3://{s3_auth.bucket}/run",
        endpoint_url=s3_auth.endpoint,
        key="AKIANOSUCHKEY0000000",
        secret="hunter2-secret",
    )
    assert "rejected the credentials (InvalidAccessKeyId)" in str(err)
    assert "AWS_ACCESS_KEY_ID" in str(err) and "hunter2" not in str(err)


def test_wrong_secret_is_named(s3_auth):
    err = _probe(
        f"s3://{s3_auth.bucket}/run",
        endpoint_url=s3_auth.endpoint,
        key=s3_auth.read_write["key"],
        secret="not-the-secret",
    )
    assert "rejected the credentials (SignatureDoesNotMatch)" in str(err)
    assert "not-the-secret" not in str(err)


def test_read_only_location_is_named_and_left_untouched(s3_auth):
    import s3fs

    admin = s3fs.S3FileSystem(endpoint_url=s3_auth.endpoint, **s3_auth.read_write)
    admin.pipe_file(f"{s3_auth.bucket}/ro/keep.bin", b"precious")
    err = _probe(f"s3://{s3_auth.bucket}/ro", endpoint_url=s3_auth.endpoint, **s3_auth.read_only)
    assert "is not writable" in str(err) and "s3:PutObject" in str(err)
    assert admin.cat_file(f"{s3_auth.bucket}/ro/keep.bin") == b"precious"


def test_missing_bucket_is_named(s3_auth):
    err = _probe("s3://no-such-bucket/run", endpoint_url=s3_auth.endpoint, **s3_auth.read_write)
    assert "does not exist" in str(err) and "aws s3 mb" in str(err)


def test_unreachable_endpoint_is_named():
    from tests.helpers.net import free_port

    err = _probe(
        "s3://b/run",
        endpoint_url=f"http://127.0.0.1:{free_port()}",
        key="k",
        secret="s",
        # botocore's own retries would outlast the 2 s probe deadline many times over here.
        config_kwargs={"retries": {"total_max_attempts": 1}},
    )
    assert "could not be reached within 2s" in str(err) and "endpoint_url" in str(err)


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES])
def test_read_only_local_directory_is_named(tmp_path, monkeypatch, code):
    # Tests run as root, where chmod cannot make a directory read-only; fail the write instead.
    def refuse(self, path, data):
        raise OSError(code, "Read-only file system" if code == errno.EROFS else "Permission denied")

    monkeypatch.setattr(LocalBackend, "create", refuse)
    err = _probe(str(tmp_path / "c"))
    assert "is not writable" in str(err) and str(tmp_path / "c") in str(err)


def test_an_endpoint_that_ignores_conditional_writes_is_named_and_then_looked_at_first(
    s3_bucket, monkeypatch, caplog
):
    """An S3 look-alike that ignores ``If-None-Match`` would let a second create overwrite: the
    probe creates its object twice, warns, and from then on the store looks before it creates."""
    import logging

    url, options = s3_bucket
    store = storage.open_store(f"{url}/run", storage_options=options)
    fs = store._backend.fs
    real = fs.pipe_file

    def ignores_the_condition(path, data, mode="overwrite", **kwargs):
        return real(path, data, **kwargs)  # every write overwrites

    monkeypatch.setattr(fs, "pipe_file", ignores_the_condition)
    assert store._backend.create_guarantee == "atomic"
    with caplog.at_level(logging.WARNING, logger="storage.probe"):
        store.probe()
    assert "ignored a conditional write (If-None-Match)" in caplog.text
    assert store._backend.create_guarantee == "checked" and store._backend.look_first
    entry, _ = store.write_file(1, "state-g1.bin", b"first")
    with pytest.raises(storage.FileConflictError):
        store.write_file(1, "state-g1.bin", b"other")
    assert bytes(store.read_uncommitted(1, "state-g1.bin")) == b"first"
