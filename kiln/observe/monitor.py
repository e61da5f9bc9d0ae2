"""What ``kiln monitor`` prints and ``kiln top`` draws: periodic reports on the host's kiln processes.

Reports have the shape of neuron-monitor's, key names included, so a
dashboard or exporter written for neuron-monitor reads kiln's output too:

- ``neuron_runtime_data``: one entry per kiln process (from the heartbeat
  registry), each with ``execution_stats`` (calls completed, failed and timed
  out in the period; latency percentiles in seconds, from the difference of
  two latency histograms), ``memory_used`` and ``neuroncore_counters`` (per
  kiln core, the share of the period the process's models were running on it);
  kiln adds ``models`` with per-model throughput, latency and host-fallback share.
- ``system_data``: vCPU usage over the period and host memory.
- ``instance_info`` and ``neuron_hardware_info``: the host, its kiln cores and engines.

A process seen for the first time counts from zero, so its first report
covers everything it has done since it loaded its models.
"""
from __future__ import annotations

import json
import os
import platform
import socket
import sys
import time

from kiln.observe import registry
from kiln.observe.metrics import hist_percentile, label

_PCTS = (("p0", 0), ("p1", 1), ("p25", 25), ("p50", 50), ("p75", 75), ("p99", 99), ("p100", 100))


def host_info(engines: bool = True) -> dict:
    """This host's kiln cores, ISA, memory and (optionally) engines with versions."""
    import psutil
    from kiln.host import cores as placement
    from kiln.host import target as target_mod
    vm = psutil.virtual_memory()
    info = {"cores": [{"id": c.id, "host_index": c.host_index, "cpus": list(c.cpus)} for c in placement.visible()],
            "arch": target_mod.arch(), "isa": target_mod.describe("native")["isa"],
            "memory_total_bytes": vm.total, "memory_available_bytes": vm.available}
    if engines:
        from kiln.engines import versions
        info["engines"] = versions()
    return info


def _busy(model: dict) -> float:
    return model["device_seconds"] + model["host_seconds"]


def _hist_delta(now: dict, before: dict | None) -> dict:
    before = before or {}
    return {k: n - before.get(k, 0) for k, n in now.items() if n - before.get(k, 0) > 0}


class Sampler:
    """Turns successive registry reads into per-period reports."""

    def __init__(self, directory: str | None = None):
        import psutil
        self.directory = directory
        self._models: dict = {}          # (pid, model id) -> the model's previous snapshot
        self._t = time.monotonic()
        self._cpu = psutil.cpu_times(percpu=True)
        self._hw = None

    def sample(self) -> dict:
        import psutil
        now = time.monotonic()
        period = max(now - self._t, 1e-6)
        cpu = psutil.cpu_times(percpu=True)
        vcpu = _vcpu_usage(self._cpu, cpu)
        self._t, self._cpu = now, cpu
        seen, runtime = {}, []
        for entry in registry.processes(self.directory):
            runtime.append(self._process(entry, period, seen))
        self._models = seen
        vm = psutil.virtual_memory()
        if self._hw is None:
            info = host_info()
            self._hw = {"neuroncore_count": len(info["cores"]),
                        "cores": {str(c["id"]): c["cpus"] for c in info["cores"]},
                        "arch": info["arch"], "isa": info["isa"], "engines": info["engines"],
                        "logical_processor_count": psutil.cpu_count()}
        busy = {cid: round(sum(100 - vcpu["usage_data"].get(str(c), {}).get("idle", 100)
                               - vcpu["usage_data"].get(str(c), {}).get("iowait", 0) for c in cpus) / len(cpus), 2)
                for cid, cpus in self._hw["cores"].items()}
        return {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "period": round(period, 3),
            "neuron_runtime_data": runtime,
            "system_data": {
                "vcpu_usage": {"period": round(period, 3), **vcpu},
                "kiln_core_cpu_usage": busy,   # per kiln core: % of its CPUs busy (any process)
                "memory_info": {"period": round(period, 3), "memory_total_bytes": vm.total,
                                "memory_used_bytes": vm.total - vm.available,
                                "swap_total_bytes": psutil.swap_memory().total,
                                "swap_used_bytes": psutil.swap_memory().used},
            },
            "instance_info": {"hostname": socket.gethostname(), "arch": platform.machine(),
                              "os": platform.platform(terse=True)},
            "neuron_hardware_info": self._hw,
        }

    def _process(self, entry: dict, period: float, seen: dict) -> dict:
        pid = entry["pid"]
        completed = failed = timed_out = 0
        hist: dict = {}
        slowest = None
        cores: dict = {}
        models = []
        for m in registry.top_level(entry):
            prev = self._models.get((pid, m["id"]))
            seen[(pid, m["id"])] = m
            d_done = m["calls_completed"] - (prev["calls_completed"] if prev else 0)
            d_fail = m["calls_failed"] - (prev["calls_failed"] if prev else 0)
            d_tout = m.get("calls_timed_out", 0) - (prev.get("calls_timed_out", 0) if prev else 0)
            d_hist = _hist_delta(m.get("latency_hist", {}), prev.get("latency_hist") if prev else None)
            d_busy = _busy(m) - (_busy(prev) if prev else 0.0)
            d_host = m["host_seconds"] - (prev["host_seconds"] if prev else 0.0)
            # first seen: the counts cover the model's life so far, so rates are over that span
            span = period if prev else max(time.time() - m.get("loaded_at", 0), period)
            # a bin answers with its middle: never above the slowest call the model recorded
            top = (m.get("latency_ms") or {}).get("max")
            cap = top / 1e3 if isinstance(top, (int, float)) else None
            if cap is not None:
                slowest = cap if slowest is None else max(slowest, cap)
            completed, failed, timed_out = completed + d_done, failed + d_fail, timed_out + d_tout
            for k, n in d_hist.items():
                hist[k] = hist.get(k, 0) + n
            core = "unpinned" if m["core"] is None else str(m["core"])
            c = cores.setdefault(core, {"neuroncore_utilization": 0.0, "models": []})
            c["neuroncore_utilization"] += 100.0 * d_busy / span
            c["models"].append(label(m))
            models.append({
                "name": m["name"], "served_as": m.get("served_as"), "kind": m["kind"], "core": m["core"],
                "completed": d_done, "failed": d_fail, "timed_out": d_tout,
                "completed_total": m["calls_completed"], "failed_total": m["calls_failed"],
                "throughput": round(d_done / span, 3),
                "latency_ms": {q: _ms(hist_percentile(d_hist, v, cap)) for q, v in (("p50", 50), ("p99", 99))},
                "host_share": round(d_host / d_busy, 4) if d_busy > 0 else 0.0,
                "bucket_hits": m.get("bucket_hits", {}),
            })
        for name, c in cores.items():
            u = c["neuroncore_utilization"]
            c["neuroncore_utilization"] = round(min(u, 100.0) if name != "unpinned" else u, 2)
        lat = {q: float(f"{hist_percentile(hist, v, slowest):.6g}") for q, v in _PCTS} if hist else None
        return {
            "pid": pid, "neuron_runtime_tag": entry.get("tag") or entry.get("cmd", ""), "error": "",
            "report": {
                "execution_stats": {
                    "period": round(period, 3),
                    "error_summary": {"generic": failed, "timeout": timed_out},
                    "execution_summary": {"completed": completed, "completed_with_err": 0,
                                          "failed": failed, "timed_out": timed_out},
                    "latency_stats": {"total_latency": lat},
                },
                "memory_used": {"period": round(period, 3),
                                "neuron_runtime_used_bytes": {"host": entry.get("memory_rss_bytes", 0),
                                                              "neuron_device": 0}},
                "neuroncore_counters": {"period": round(period, 3), "neuroncores_in_use": cores},
                "models": models,
                "compile_cache": entry.get("compile_cache", {}),
            },
        }


def _vcpu_usage(before, after) -> dict:
    fields = ("user", "nice", "system", "idle", "iowait", "irq", "softirq")
    per, total = {}, dict.fromkeys(fields, 0.0)
    for i, (a, b) in enumerate(zip(before, after)):
        d = {f: max(getattr(b, f, 0.0) - getattr(a, f, 0.0), 0.0) for f in fields}
        span = sum(d.values()) or 1e-9
        per[str(i)] = {f: round(100 * v / span, 2) for f, v in d.items()}
        for f in fields:
            total[f] += d[f]
    span = sum(total.values()) or 1e-9
    return {"average_usage": {f: round(100 * v / span, 2) for f, v in total.items()}, "usage_data": per}


def _ms(seconds):
    return None if seconds is None else round(seconds * 1e3, 3)


def run(period: float = 5.0, count: int | None = None, directory: str | None = None, out=None) -> int:
    """Print one JSON report per line every ``period`` seconds (``count`` of them, or forever)."""
    out = out or sys.stdout
    sampler = Sampler(directory)
    n = 0
    try:
        while count is None or n < count:
            time.sleep(period)
            out.write(json.dumps(sampler.sample()) + "\n")
            out.flush()
            n += 1
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:   # `kiln monitor | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
