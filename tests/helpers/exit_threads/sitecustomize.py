"""Loaded into every Python process of a test's job (``tests.helpers.threads_at_exit``): at exit,
after every other atexit handler (this one is registered first, so it runs last), the process
prints the threads it still runs, just before the interpreter finalizes."""

import atexit
import os
import sys
import threading


def _report() -> None:
    alive = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    sys.stderr.write(f"THREADS AT EXIT pid={os.getpid()} {alive}\n")
    sys.stderr.flush()


atexit.register(_report)
