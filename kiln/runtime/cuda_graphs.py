"""A compiled model on an NVIDIA GPU, replayed as one CUDA graph per compiled shape.

At batch 1 a GPU model's time goes mostly to launching kernels, not running them: BERT-base
is a few hundred Triton kernels and cuBLAS calls, each launched from the CPU through
AOTInductor's runtime. A CUDA graph records every launch of one call once and replays them
all with a single call: what ``torch.compile(mode="reduce-overhead")`` does for Inductor's
own graphs, done here for a kiln artifact's whole host program (every partition, and host
operations on GPU tensors).

How a call runs once captured:

* the inputs, wherever they are (CPU or GPU), are copied into the graph's own input
  buffers, the graph is replayed on the caller's current stream, and the outputs are copied
  out: to the CPU for a CPU caller, into fresh GPU tensors for a GPU caller. The graph's
  output buffers are overwritten by the next replay; a copy means a caller holding call N's
  outputs still holds them after call N+1 (the copy is one small kernel per output);
* the next call's stream waits for the previous call's copies (an event), so two threads
  on different streams never overwrite inputs a replay is still reading; a lock keeps
  copy-in, replay and copy-out of one call together.

One graph per compiled model: an artifact has static shapes, and its buckets and batch
sizes are compiled models of their own (``kiln.runtime.buckets``), so each gets its graph.

Capture happens at the second call: the first runs uncaptured, so a model called once (the
compile's check against eager, a one-off script) never pays for one. It uses an instance of
the program of its own, loaded again from the artifact's blobs (host constants on the GPU,
as the model's own: ``CompiledModel`` runs a CUDA artifact's whole program there).
AOTInductor's container records an event after each run to know when a model instance is
free and queries those events when none is; a query is not allowed while a stream is
capturing, and an event recorded during a capture cannot be queried afterwards, so an
instance that ran directly may fail a capture and a captured one fails its next direct run
(both seen on an H100 with the decode graphs of :mod:`kiln.runtime.cuda_llm`, which capture
the same way). The captured instance
belongs to its graph from then on; uncaptured calls (profiled ones, step by step) keep the
model's own. The price is a second copy of the weights on the GPU.

A program that cannot be captured (an operation that waits for the CPU, a shape that
depends on data, a host operation that leaves the GPU) runs uncaptured from then on, with a
warning that says why: slower, never wrong. ``KILN_CUDA_GRAPHS=off`` or
``RuntimeOptions(cuda_graphs=False)`` turns capture off.
"""
from __future__ import annotations

import threading
import warnings

import torch


class GraphedProgram:
    """Runs flat GPU-model inputs through a captured CUDA graph (module doc).

    ``load()`` returns a fresh instance of the program (a callable on a list of GPU
    tensors); it is called once, at capture. ``state`` says where the graph stands:
    ``"waiting"`` (not captured yet), ``"captured"``, or ``"uncaptured: <why>"``."""

    def __init__(self, load, device, name: str = "model"):
        self._load = load
        self.device = torch.device(device)
        self.name = name
        self.state = "waiting"
        self.replays = 0
        self._lock = threading.Lock()
        self._graph = None
        self._inputs: list = []
        self._outputs: list = []
        self._done = None            # an event after the last call's copy-out
        self._program = None         # the captured instance (the graph reads its weights)
        self._calls = 0

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def __call__(self, flat: list):
        """The outputs of one call, or None when the program runs uncaptured (the caller
        then runs its own instance)."""
        if self._graph is None and self.state != "waiting":
            return None
        with self._lock:
            if self._graph is None:
                self._calls += 1
                if self._calls < 2 or self.state != "waiting" or not self._try_capture(flat):
                    return None
            stream = torch.cuda.current_stream(self.device)
            if self._done is not None:
                stream.wait_event(self._done)
            for static, t in zip(self._inputs, flat):
                static.copy_(t, non_blocking=True)
            self._graph.replay()
            self.replays += 1
            on_gpu = bool(flat) and flat[0].device.type == "cuda"
            outs = [o.clone() if on_gpu else o.to("cpu") for o in self._outputs]
            if self._done is None:
                self._done = torch.cuda.Event()
            self._done.record(stream)
        return outs

    def _try_capture(self, flat) -> bool:
        try:
            self._capture(flat)
            self.state = "captured"
            return True
        except Exception as e:  # noqa: BLE001 - the uncaptured program still answers; say why it is slower
            why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            self.state = f"uncaptured: {why}"
            self._graph, self._program, self._inputs, self._outputs = None, None, [], []
            reset = end_failed_capture(self.device)
            warnings.warn(f"kiln: {self.name} could not be captured as a CUDA graph ({why}); its calls "
                          f"launch their kernels one by one instead, slower{reset}", RuntimeWarning, stacklevel=4)
            return False

    def _capture(self, flat):
        program = self._load()
        device = self.device
        inputs = [torch.empty(t.shape, dtype=t.dtype, device=device).copy_(t) for t in flat]
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        # the warm-up draws no random numbers from the caller's generators: a graph with
        # dropout draws at replay what eager would have drawn at this call
        cpu_state, gpu_state = torch.random.get_rng_state(), torch.cuda.get_rng_state(device)
        with torch.cuda.stream(side):
            program(inputs)          # first-run set-up (kernel loads, cuBLAS workspaces) stays out of the graph
        current.wait_stream(side)
        torch.random.set_rng_state(cpu_state)
        torch.cuda.set_rng_state(gpu_state, device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = list(program(inputs))
        elsewhere = [i for i, o in enumerate(outputs)
                     if not isinstance(o, torch.Tensor) or o.device.type != "cuda"]
        if elsewhere:
            raise RuntimeError(f"output(s) {elsewhere} of the captured program are not on the GPU")
        self._graph, self._program, self._inputs, self._outputs = graph, program, inputs, outputs


def end_failed_capture(device) -> str:
    """Leave the GPU's random-number generator usable after a capture that failed; returns
    "" or, where that failed too, a sentence for the caller's warning.

    A capture that fails at its end (CUDA reports the capture invalidated, e.g. by a read
    back to the CPU inside it) raises from PyTorch's ``CUDAGraph.capture_end`` before it
    ends the capture of the device's default generator, which stays "capturing" for the rest
    of the process: every later random draw on that GPU, and every kernel that advances the
    generator, fails with "Offset increment outside graph capture encountered unexpectedly"
    (seen on an H200: a kiln compile after such a failure). A capture of one tiny kernel that
    succeeds ends the generator's capture properly, on the same generator state, so graphs
    captured earlier keep theirs."""
    try:
        device = torch.device(device)
        with torch.cuda.device(device):
            scratch = torch.zeros(1, device=device)
            scratch.add_(1)                 # loaded before the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                scratch.add_(1)
            del graph
        return ""
    except Exception as e:  # noqa: BLE001 - reported in the caller's warning
        return (f" (and a capture to reset the GPU's random-number generator failed too: "
                f"{type(e).__name__}: {str(e).splitlines()[0][:200]}; random draws on this GPU "
                "may fail from here on)")
