"""Phase progress for long work (capture, compile, validate).

On a terminal a live line shows the phase and its elapsed time; elsewhere (CI
logs, pipes) phases go to the ``kiln`` logger only, so nothing scrolls noise.
``KILN_QUIET=1`` or ``quiet=True`` silences the terminal line too.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time

from kiln import config

log = logging.getLogger("kiln")


class Progress:
    def __init__(self, label: str = "kiln", quiet: bool | None = None, stream=None):
        self.stream = stream or sys.stderr
        if quiet is None:
            quiet = (config.get("KILN_QUIET") or "") not in ("", "0")
        self.live = (not quiet) and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.label = label
        self.timings: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        stop = threading.Event()
        ticker = None
        if self.live:
            def tick():
                while not stop.wait(0.2):
                    self.write(f"{self.label}: {name} … {time.perf_counter() - start:5.1f}s")
            ticker = threading.Thread(target=tick, daemon=True)
            ticker.start()
        try:
            yield
        finally:
            stop.set()
            if ticker:
                ticker.join()
            elapsed = time.perf_counter() - start
            self.timings[name] = self.timings.get(name, 0.0) + elapsed
            log.info("%s: %s took %.2fs", self.label, name, elapsed)
            if self.live and elapsed >= 1.0:
                self.write(f"{self.label}: {name} done in {elapsed:.1f}s\n")
            elif self.live:
                self.write("")

    def write(self, text: str):
        self.stream.write("\r\033[K" + text)
        self.stream.flush()
