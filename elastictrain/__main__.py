"""``torchrun ... -m elastictrain [flags]`` trains; ``python -m elastictrain ls URL`` inspects."""

from __future__ import annotations

import logging
import sys

import storage
from elastictrain.errors import EXIT_STORAGE, EXIT_USER_ERROR, ElasticTrainError

logger = logging.getLogger("elastictrain")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
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


if __name__ == "__main__":
    sys.exit(main())
