"""How a loaded model runs: engine threads and the CPUs it may use.

Kept apart from the compile options because a model is loaded, and these are chosen,
where it runs, not where it was compiled.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kiln import config

# Whether engine threads may busy-wait by default. A process that shares the cores with
# another that keeps them busy (the device's compile process beside a training loop that
# steps on: kiln.device.compile_process) turns it off: there, two threads spinning on one
# free core made its NaN probes and timings 5-10x as long (BERT-4L: 183 s against 39 s).
_SPIN = [True]


def yield_threads():
    """Engine threads of this process yield instead of busy-waiting from now on."""
    _SPIN[0] = False


@dataclass(frozen=True)
class RuntimeOptions:
    threads: int | None = None        # engine threads; None = the CPUs the model may run on
    cpus: tuple | None = None         # the CPUs of the model's kiln core(s); None = the process's
    # engine threads may busy-wait between calls: faster for one engine called back to back,
    # ruinous when several partitions and host operations take turns on the same CPUs
    spin: bool = field(default_factory=lambda: _SPIN[0])
    # a model compiled for an NVIDIA GPU replays each call as a captured CUDA graph
    # (kiln.runtime.cuda_graphs); None = KILN_CUDA_GRAPHS (default on)
    cuda_graphs: bool | None = None

    def resolved_threads(self) -> int:
        from kiln.host.cores import available_cpus
        if self.threads:
            return int(self.threads)
        env = config.get("KILN_NUM_THREADS")
        if env:
            return int(env)
        return len(self.cpus) if self.cpus else available_cpus()

    def resolved_cuda_graphs(self) -> bool:
        if self.cuda_graphs is not None:
            return bool(self.cuda_graphs)
        return (config.get("KILN_CUDA_GRAPHS") or "on").strip().lower() not in ("0", "off", "false", "no")
