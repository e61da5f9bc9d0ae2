"""``kiln bench`` / ``kiln.bench``: throughput and latency of kiln and its peers, NeuronPerf-style.

What it guards against is measuring the wrong thing: a cold compile cache,
one-off setup, a noisy neighbour process. So:

- Compiling happens before anything is timed (through the compile cache),
  and each runner warms up for ``warmup`` seconds before its window.
- Every model copy is its own process pinned to its own kiln core (copy i on
  core i mod N), as NeuronPerf runs one model per NeuronCore; ``workers``
  threads per copy call it back to back. All copies of a configuration run
  their windows at the same time.
- Peers (``compare``: eager, torchscript, torch.compile, onnxruntime,
  openvino) run the same model on the same inputs under the same pinning in
  the same run, so the table's ratios compare like with like. A peer that is
  not installed is skipped with a note. Peers need the model itself, so they
  need a factory target (``module:function``), not an artifact.
- kiln rows report the share of time spent in host fallback ops, so a
  fallback hiding in a fast-looking number is visible.

Targets: a ``.kiln`` artifact (a batch size other than the compiled one runs
through dynamic batch), a factory ``package.module:function`` returning
``(model, example_inputs)`` (compiled per batch size; the example's dim 0 is
resized), or a loaded kiln model.

Modules: ``runner`` (the sweep and the copy processes it starts),
``child`` (one copy's process), ``inputs`` (factory and spec inputs),
``report`` (rows, ratios, JSON, table, notes, plot), ``peers`` (the
alternatives).
"""
from kiln.benchmark.report import notes, plot, table
from kiln.benchmark.runner import bench

__all__ = ["bench", "notes", "plot", "table"]
