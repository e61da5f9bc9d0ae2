"""The engine contract: what kiln asks of an engine, and what an engine says about itself.

An engine turns one device partition (a GraphModule of core ATen ops, weights
inside) into a self-contained blob at compile time, and that blob into a
callable at load time. Everything kiln needs to *choose* an engine is an
attribute of the engine, so that selection, the compile cache, the trust
check and ``kiln ls`` read capabilities instead of knowing engine names, and
an engine kiln has never heard of (a plugin, see ``kiln.engines``) is chosen
by the same rules as the built-in ones.

Constructing an engine must be cheap and must not import its package: the
registry builds engines to read these attributes on hosts where the package is
missing, and ``import kiln`` must stay fast.
"""
from __future__ import annotations

import importlib
import importlib.metadata

import torch


class Engine:
    """One engine. Subclasses set the attributes and implement supports/compile/load.

    Description (class attributes, read without the engine's package installed):

    * ``name``: what ``engine=`` and the manifest call it; ``title``: its name in prose.
    * ``devices``: where its builds run (``("cpu",)``, ``("cpu", "cuda")``).
    * ``priority``: ``{device: rank}``, its place in kiln's default order on that device
      (lower first). A device left out: the engine runs there only when named.
    * ``fallback``: after an engine the user names, kiln still tries this one on
      partitions the named one cannot compile (it runs any ATen op).
    * ``prefers_attention``: at -O2 partitions with attention go to this engine first
      (measured faster on them).
    * ``quantizes``: the ``quantize=`` modes its ``compile`` implements (``("int8",)``);
      a quantized partition never goes to another engine. ``quantize_modes``: the
      ``quantize_mode=`` values it implements them in.
    * ``package``: the distribution whose version is recorded (``pip install`` name);
      ``modules``: the Python modules it needs, all importable when it is available;
      ``load_modules``: the ones loading a blob needs, where fewer (None: ``modules``).
      Loading checks only those: ONNX Runtime's exporter (onnxscript) took 0.3-0.5 s of
      a 1 s SmolLM2 load to import, for nothing a load runs.
    * ``native_code``: loading a blob runs machine code from it (a shared library);
      such partitions load only from artifacts this host trusts
      (``kiln.artifact.trust``). Engines whose blobs are data they parse leave it False.
    * ``blob_suffix``: the blob's file suffix inside the artifact.
    * ``draws_from_torch``: its builds draw random numbers (dropout) by calling PyTorch's
      own random kernels on its default generator, in the graph's order, so a seed gives
      eager's numbers. Operations that draw go to the host on engines without it
      (:mod:`kiln.graph.randomness`).
    * ``checks_indices``: an index out of range is an error on it, as in eager (eager's
      kernels; Inductor's, with :mod:`kiln.engines.inductor_bounds`). On engines without
      it, an index the graph computes and kiln cannot prove in range runs on the host
      (:mod:`kiln.graph.computed_indices`).
    """

    name: str = ""
    title: str = ""
    devices: tuple = ("cpu",)
    priority: dict = {}
    fallback: bool = False
    prefers_attention: bool = False
    quantizes: tuple = ()
    quantize_modes: tuple = ("dynamic", "static", "weight_only")
    package: str = ""
    modules: tuple = ()
    load_modules: tuple | None = None
    native_code: bool = False
    blob_suffix: str = ".bin"
    draws_from_torch: bool = False
    checks_indices: bool = False

    # -- description that depends on the host ---------------------------------------

    def missing(self, purpose: str = "compile") -> str | None:
        """Why this engine cannot run here (a module that does not import), or None.
        ``purpose="load"``: only what loading a blob needs (``load_modules``)."""
        needed = self.load_modules if purpose == "load" and self.load_modules is not None else self.modules
        for module in needed:
            try:
                importlib.import_module(module)
            except ImportError as e:
                return f"{module} cannot be imported: {e}"
        return None

    def available(self) -> bool:
        return self.missing() is None

    def version(self) -> str:
        """The version recorded with its builds; it starts with ``package``'s version."""
        try:
            return importlib.metadata.version(self.package)
        except importlib.metadata.PackageNotFoundError:
            return importlib.import_module(self.modules[0]).__version__

    def package_version(self) -> str | None:
        """``package``'s installed version from its metadata (no import), or None."""
        try:
            return importlib.metadata.version(self.package)
        except (importlib.metadata.PackageNotFoundError, ValueError):
            return None

    def native_types(self, device: str = "cpu") -> tuple:
        """The reduced float types ("bf16", "fp16") its builds compute natively on this
        host's ``device``; kiln emulates the others' rounding for --auto-cast."""
        return ()

    # -- what it does ---------------------------------------------------------------

    @classmethod
    def not_aten(cls, node) -> str | None:
        """Reason a node is not an ATen operator an engine may compile (None if it is)."""
        target = node.target
        if not isinstance(target, torch._ops.OpOverload):
            return cls.not_an_op(node)
        if target.namespace != "aten":
            # Compiled in, it would be called back through the dispatcher; on
            # the host it runs the same kernel and a missing library is named.
            return "not an ATen operator: custom operators run on the host"
        return None

    @staticmethod
    def dtypes(node):
        """The dtypes of the tensors ``node`` makes and reads: an engine without kernels for
        one cannot take the node, whose inputs (a bf16 -> float32 cast's) become its
        partition's inputs."""
        for v in [node.meta.get("val")] + [a.meta.get("val") for a in node.all_input_nodes]:
            for t in v if isinstance(v, (list, tuple)) else [v]:
                if isinstance(t, torch.Tensor):
                    yield t.dtype

    @staticmethod
    def not_an_op(node) -> str | None:
        """Reason a non-operator node cannot be compiled (tuple unpacking is fine)."""
        if getattr(node.target, "__name__", "") == "getitem":
            return None
        return f"{node.target} is not an ATen operator"

    def supports(self, node) -> str | None:
        """None if this engine can run the fx node, otherwise why not (analysis reports it)."""
        raise NotImplementedError

    def variants(self, options) -> tuple:
        """Other builds of a partition that -O3 also times (passed back as ``variant=``),
        for settings that win on some models and lose on others."""
        return ()

    def compile(self, partition, example_inputs, options, *, variant=None, calibration=None) -> bytes:
        """A self-contained, fully optimised blob for ``partition``.

        ``variant``: None for the default build, else one of ``variants(options)``.
        ``calibration``: when ``options.quantize`` asks for calibrated int8, a list of
        partition input lists to calibrate on; engines that do not quantize ignore it.
        Raising anything but a ``KilnError`` records the engine as failed on this
        partition and selection moves on to the next engine.
        """
        raise NotImplementedError

    def quantized_products(self, blob) -> dict | None:
        """What a quantized build holds: ``{"quantized": n, "float": n, "ops": {...}}``, its
        weighted products quantized and left in float (:mod:`kiln.engines.onnx_products`), or
        None where the engine does not say. Recorded in the manifest, so that a build asked
        for int8/int4 that quantized nothing is seen, not only slow."""
        return None

    def load(self, blob, runtime_options, origin=None, shared=None):
        """A callable from a list of input tensors to a list of output tensors, safe to
        call from several threads at once. ``blob`` may be a read-only view into a mapped
        artifact; ``origin`` (``kiln.artifact.container.Origin``), when given, says where
        those bytes lie in a file, for engines that map weights instead of copying them.
        ``shared`` (``Artifact.shared``): name -> ``(data, origin)`` of a member of the
        artifact or one enclosing it, for blobs that read weights stored once for several
        graphs (:mod:`kiln.runtime.ort_pool`); given only for graphs whose manifest lists
        ``shared_blobs``, so engines written before it load everything else unchanged.
        The callable may offer ``signature()``: ([(shape, dtype)] of inputs, of outputs)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<kiln engine {self.name!r}>"
