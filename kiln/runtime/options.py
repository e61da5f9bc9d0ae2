"""How a loaded model runs: engine threads and the CPUs it may use.

Kept apart from the compile options because a model is loaded, and these are chosen,
where it runs, not where it was compiled.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln import config


@dataclass(frozen=True)
class RuntimeOptions:
    threads: int | None = None        # engine threads; None = the CPUs the model may run on
    cpus: tuple | None = None         # the CPUs of the model's kiln core(s); None = the process's
    # engine threads may busy-wait between calls: faster for one engine called back to back,
    # ruinous when several partitions and host operations take turns on the same CPUs
    spin: bool = True

    def resolved_threads(self) -> int:
        from kiln.host.cores import available_cpus
        if self.threads:
            return int(self.threads)
        env = config.get("KILN_NUM_THREADS")
        if env:
            return int(env)
        return len(self.cpus) if self.cpus else available_cpus()
