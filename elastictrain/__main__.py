"""``torchrun ... -m elastictrain [flags]`` trains; ``python -m elastictrain ls|verify|inspect|prune
URL``, ``report EVENTS`` and ``bench`` are the tools."""

from __future__ import annotations

import logging
import os
import sys

import storage
from elastictrain.errors import EXIT_STORAGE, EXIT_USER_ERROR, ElasticTrainError

logger = logging.getLogger("elastictrain")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from elastictrain import bench

        return bench.main(argv[1:])
    if argv and argv[0] == "report":
        from elastictrain import report

        return report.main(argv[1:])
    if argv and argv[0] in ("ls", "verify", "inspect", "prune"):
        from elastictrain import cli

        try:
            return cli.main(argv)
        except (ElasticTrainError, storage.StorageError) as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_USER_ERROR
    from elastictrain.config import parse_args
    from elastictrain.runner import run

    try:
        cfg = parse_args(argv)
        return run(cfg)
    except (ElasticTrainError, storage.StorageError) as e:
        # Expected failures: one clear line, no traceback to dig through, and a code that says which.
        code = getattr(e, "exit_code", _storage_exit_code(e))
        logger.error("FAILED (exit %d): %s: %s", code, type(e).__name__, e)
        return code


def _storage_exit_code(e: Exception) -> int:
    """A location that fails its probe needs the user (2); storage that went away mid-run (7)."""
    if isinstance(e, storage.StorageUnavailableError) and not isinstance(
        e, storage.StorageNotUsableError
    ):
        return EXIT_STORAGE
    return EXIT_USER_ERROR


def _exit_now(code: int) -> None:
    """Exit without interpreter finalization once everything is committed and flushed.

    A training process holds C++ threads (gloo, the c10d store, torch's pools) whose teardown
    during finalization can abort the process ("terminate called without an active exception",
    SIGABRT) after a clean finish, which torchrun would count as a failure and restart. Seen once
    in about a hundred finishes here; nothing is left to do at this point, so skip that teardown.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    code = main()
    if len(sys.argv) > 1 and sys.argv[1] in ("ls", "verify", "inspect", "prune", "bench", "report"):
        sys.exit(code)
    _exit_now(code)
