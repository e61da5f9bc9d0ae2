"""An LLM compiled for an NVIDIA GPU, run by the same scheduler as on a CPU.

``compile_llm(..., device="cuda")`` compiles each graph (prefill per context bucket,
decode per batch size, chunk, verify) with TorchInductor through AOTInductor, as
``kiln.trace(device="cuda")`` does any model: Triton kernels and cuBLAS calls in one
package per graph, stored in the artifact, loaded without recompiling. What this module
adds is how those graphs run inside :mod:`kiln.runtime.scheduler`, which is unchanged:

* **The KV cache lives on the GPU.** :class:`kiln.runtime.kv.CacheMemory` hands each scheduler's
  :class:`~kiln.runtime.kv.KVCache` its two buffers on the GPU (``kv.placed``), and the
  same buffers to every later scheduler once the previous one is gone, so the cache's
  addresses stay put for the life of the model. The lengths and the valid-position mask
  stay on the CPU, where the scheduler reads them; each step's new keys and values are
  written into the GPU buffers by the scheduler's own ``write_slot`` (a GPU copy).
* **Decode steps are replayed as CUDA graphs.** :class:`GraphedDecode` captures a decode
  graph's whole step (every kernel of every layer) once per set of cache addresses, the
  first time it is called on them, and replays it at every later step: the scheduler's
  small token, position and mask tensors are copied into the graph's own inputs, the
  cache views are read where they are, and the logits come back to the CPU (the
  scheduler samples there, with each request's own generator); the new keys and values
  stay on the GPU, in the graph's output buffers, until the next replay overwrites them.
  Replay launches the step with one call instead of one per kernel: for SmolLM2-135M
  that is most of a step's time (docs/llm.md, "NVIDIA GPUs").
* **Prefill, chunk and verify graphs run as they are** (:class:`GpuStep`): inputs moved
  to the GPU, logits back to the CPU. They run once per request or per chunk.

Why each capture loads a model instance of its own: AOTInductor's container (torch's
package loader, four model instances) records an event at the end of every run to know
when an instance is free again, and when none is free it queries those events before the
next run. That query is not allowed while a CUDA graph is being captured ("operation not
permitted when stream is capturing"), so capturing on an instance that earlier direct
calls (the batch-invariance probe, ``warm_graphs``) had used up failed or not depending on
how many calls came before (seen with ``kiln llm generate``, torch 2.11, H100); and an event
recorded during a capture cannot be queried afterwards, so a captured instance fails its
next direct run ("invalid argument"). Each capture therefore loads a fresh instance from the
graph's own bytes (four free models: one for the warm-up run, one for the captured run), which
belongs to its CUDA graph from then on (the graph reads its weights); direct calls (a cache
elsewhere: the probe, a CPU cache) keep using the graph as loaded. At most :data:`MAX_GRAPHS`
captures per graph: each holds a copy of the weights.
"""
from __future__ import annotations

import dataclasses
import warnings

import torch

from kiln.artifact import trust
from kiln.artifact.container import Artifact
from kiln.errors import ArtifactError
from kiln.runtime import kv
from kiln.runtime.cuda_graphs import end_failed_capture
from kiln.runtime.model import CompiledModel

MAX_GRAPHS = 4      # captures (distinct cache addresses) per decode graph before calls run uncaptured


def is_cuda(graph) -> bool:
    """Whether ``graph`` (a compiled model) was compiled for an NVIDIA GPU."""
    manifest = getattr(graph, "manifest", None) or {}
    return manifest.get("target", {}).get("device") == "cuda"


def place(llm):
    """Wrap ``llm``'s graphs to run on the GPU (module doc) and give it the GPU cache memory
    its schedulers take (``llm.cache_memory``). Wrapping twice is harmless."""
    if not torch.cuda.is_available():
        raise ArtifactError("this LLM was compiled for an NVIDIA GPU (device='cuda') and torch sees no CUDA "
                            "device here; run it on a machine with the GPU, or compile it again with "
                            "device='cpu'")
    device = torch.device("cuda", torch.cuda.current_device())
    llm.prefill = {w: GpuStep.wrap(g, device) for w, g in llm.prefill.items()}
    llm.decode = {b: GraphedDecode.wrap(g, device) for b, g in llm.decode.items()}
    llm.chunk = GpuStep.wrap(llm.chunk, device)
    for graphs in llm.windows.values():
        graphs["decode"] = {b: GraphedDecode.wrap(g, device) for b, g in graphs["decode"].items()}
        graphs["chunk"] = GpuStep.wrap(graphs.get("chunk"), device)
    steps = getattr(llm, "verify_steps", None)
    if isinstance(steps, dict):
        llm.verify_steps = {b: GpuStep.wrap(g, device) for b, g in steps.items()}
    llm.verify = GpuStep.wrap(llm.verify, device)
    memory = getattr(llm, "cache_memory", None)
    if memory is None or memory.device != device:
        llm.cache_memory = kv.CacheMemory(device)
    return llm


def _logits_to_cpu(outputs):
    """The scheduler samples on the CPU: logits there, the new keys and values left on the GPU."""
    return (outputs[0].cpu(), *outputs[1:])


class _Wrapped:
    """A compiled graph behind a GPU runner; everything else (``to_bytes``, ``manifest``)
    is the graph's own, so the LLM saves and describes it as before."""

    def __init__(self, graph, device):
        self.graph, self.device = graph, device
        # the LLM's graphs capture as this module says, not as every GPU model does
        # (kiln.runtime.cuda_graphs): a decode step's cache views are read where they are
        graph.cuda_graph = None

    @classmethod
    def wrap(cls, graph, device):
        if graph is None or isinstance(graph, _Wrapped):
            return graph
        return cls(graph, device)

    def __getattr__(self, name):
        if name in ("graph", "device"):
            raise AttributeError(name)
        return getattr(self.graph, name)


class GpuStep(_Wrapped):
    """A prefill, chunk or verify graph: inputs to the GPU, logits back to the CPU."""

    def __call__(self, *inputs):
        return _logits_to_cpu(self.graph(*(t.to(self.device) for t in inputs)))


class _Capture:
    """One captured decode step: the CUDA graph, its small inputs (tokens, positions,
    valid mask) and its outputs, and the model instance whose weights it reads."""

    def __init__(self, graph, inputs, outputs, instance):
        self.graph, self.inputs, self.outputs, self.instance = graph, inputs, outputs, instance


class GraphedDecode(_Wrapped):
    """A decode graph replayed as a CUDA graph (module doc). Called as the scheduler calls
    a decode step: ``(tokens, positions, k_0..k_{L-1}, v_0..v_{L-1}, valid)``, the cache
    views on the GPU; anything else (CPU caches) runs uncaptured."""

    def __init__(self, graph, device):
        super().__init__(graph, device)
        self.captures: dict = {}        # cache addresses -> _Capture
        self._direct = graph            # the instance for uncaptured calls (never captured)
        self.capture_error = None       # why capturing failed, once it has (calls then run uncaptured)

    def __call__(self, tokens, positions, *rest):
        cache, valid = rest[:-1], rest[-1]
        capture = None
        if all(t.is_cuda for t in cache):
            key = tuple(t.data_ptr() for t in cache)
            capture = self.captures.get(key)
            if capture is None and self.capture_error is None and len(self.captures) < MAX_GRAPHS:
                capture = self._try_capture(key, tokens, positions, cache, valid)
        if capture is None:
            return self._run_direct(tokens, positions, *rest)
        small = capture.inputs
        small[0].copy_(tokens)
        small[1].copy_(positions)
        small[2].copy_(valid)
        capture.graph.replay()
        return _logits_to_cpu(capture.outputs)

    def _run_direct(self, *inputs):
        return _logits_to_cpu(self._direct(*(t.to(self.device) for t in inputs)))

    def _try_capture(self, *args):
        """:meth:`_capture`, or None with a warning where capturing fails: the step then runs
        uncaptured (the same kernels, launched one by one), never with a wrong answer."""
        try:
            return self._capture(*args)
        except Exception as e:  # noqa: BLE001 - the uncaptured graph still answers; say why it is slower
            self.capture_error = f"{type(e).__name__}: {e}"
            reset = end_failed_capture(self.device)
            warnings.warn(f"a decode step of this GPU LLM could not be captured as a CUDA graph "
                          f"({self.capture_error.splitlines()[0]}); its steps run uncaptured, slower{reset}",
                          RuntimeWarning, stacklevel=3)
            return None

    def _capture(self, key, tokens, positions, cache, valid):
        """Capture one step on these cache views (they are read, never written: the step's
        new keys and values are outputs), or None where the graph cannot be captured (it runs
        on a worker thread of its own)."""
        instance = _instance(self.graph)
        if getattr(instance, "worker", None) is not None:
            return None
        small = [tokens.to(self.device), positions.to(self.device), valid.to(self.device)]
        flat = [small[0], small[1], *cache, small[2]]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            instance.run_flat(flat)     # first-call set-up (cuBLAS handles, buffers) stays out of the graph
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = instance.run_flat(flat)
        capture = self.captures[key] = _Capture(graph, small, tuple(outputs), instance)
        return capture


def _instance(graph):
    """Another instance of a compiled graph, from its own bytes. The bytes are those of a
    graph this process already loaded (its native code admitted then), so they are trusted."""
    art = Artifact.from_bytes(graph.to_bytes())
    trust.admit(art, "a GPU decode graph", True)
    options = dataclasses.replace(graph.runtime_options, cuda_graphs=False)
    return CompiledModel(art, options, source="a GPU decode graph")
