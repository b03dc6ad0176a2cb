"""``torchrun ... -m elastictrain [flags]`` trains; ``python -m elastictrain COMMAND`` runs a tool.

Dispatch only: each tool is imported when it is asked for, so ``ls`` never pays for torch.
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import signal
import sys

import storage
from elastictrain.errors import EXIT_CRASH, EXIT_USER_ERROR, ElasticTrainError, exit_code
from elastictrain.runtime.signals import StopSignals, exit_without_teardown
from elastictrain.tools import TOOLS

logger = logging.getLogger("elastictrain")


def _import_runner():
    """``elastictrain.train.runner.run``, imported with the cyclic garbage collector paused.

    Importing torch, and ``torch._dynamo`` (which DDP's constructor and the first optimizer step
    import anyway), creates about 300,000 objects that live as long as the process. While they are
    created the collector runs again and again, and each full collection scans them all: about a
    fifth of a training process's start-up CPU (0.45 of 2.4 s on a 2-core host), paid by every
    restart and every spare. Paused, then frozen (``gc.freeze``: moved where no collection looks),
    they cost nothing more. The price is the imports' own cyclic garbage, kept while frozen: about
    9,000 objects, 5 MB. This is the pattern CPython documents for ``gc.freeze``. Only the runner's
    own process does it; library mode leaves the user's collector alone. A loader's fork
    (``train.loader.start_workers``) unfreezes everything afterwards: these objects are scanned
    again from then on, as they were before, and nothing is lost.
    """
    gc.disable()
    try:
        import torch._dynamo  # noqa: F401 - imported by DDP and the optimizer anyway; here, cheaper

        from elastictrain.train.runner import run
    finally:
        gc.freeze()
        gc.enable()
    return run


def main(argv: list[str] | None = None, early_signals: StopSignals | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in TOOLS:
        module = importlib.import_module(TOOLS[argv[0]][0])
        try:
            return module.main(argv if module.__name__.endswith(".cli") else argv[1:])
        except (ElasticTrainError, storage.StorageError) as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_USER_ERROR
    from elastictrain.flags import parse_args
    from elastictrain.inplace import supervisor

    try:
        cfg = parse_args(argv)
        if cfg.replace_in_place and "RANK" in os.environ and supervisor.role() is None:
            # The process torchrun watches: it never imports torch, and never exits on a death.
            rank = int(os.environ["RANK"])
            return supervisor.supervise(
                argv,
                max_replacements=cfg.max_replacements,
                rank=rank,
                stopped_s=cfg.silent_timeout or None,
            )
        return _import_runner()(cfg, early_signals)
    except (ElasticTrainError, storage.StorageError) as e:
        # Expected failures: one clear line, no traceback to dig through, and a code that says which.
        code = exit_code(e)
        # A crash keeps its cause's traceback (a dataset bug is found there); the rest need none.
        trace = e if code == EXIT_CRASH and getattr(e, "traceback_helps", True) else None
        logger.error("FAILED (exit %d): %s: %s", code, type(e).__name__, e, exc_info=trace)
        return code


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in TOOLS:
        sys.exit(main())
    # Before torch is imported (seconds on a cold start): a SIGTERM or Ctrl-C from here on is a
    # graceful stop at the first step, never a KeyboardInterrupt traceback out of an import.
    try:
        code = main(early_signals=StopSignals([signal.SIGTERM]))
    except Exception:
        # A crash is printed as Python would, and then leaves like every other exit: interpreter
        # teardown runs exit hooks that can block forever (multiprocessing joins loader workers,
        # which ignore SIGTERM while they wait for their rank's orders).
        sys.excepthook(*sys.exc_info())
        code = EXIT_CRASH
    exit_without_teardown(code)
