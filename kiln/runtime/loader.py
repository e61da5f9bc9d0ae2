"""Loading: a ``.kiln`` artifact (file or bytes) → the model object for its kind.

A single compiled graph loads as a :class:`~kiln.runtime.model.CompiledModel`; the
wrapper kinds (bucketed, dynamic batch, pipeline) load their nested artifacts through
the same :func:`from_artifact`, which they are handed rather than import, so the kinds
do not depend on the loader. Trust is checked here, before any engine sees a blob.
"""
from __future__ import annotations

from kiln.artifact import trust
from kiln.artifact.container import Artifact
from kiln.errors import ArtifactError
from kiln.runtime import buckets, llm, stages, tp_llm
from kiln.runtime.model import DEFAULT, CompiledModel, Model
from kiln.runtime.options import RuntimeOptions

# Artifact kinds other than a single compiled graph: kind -> loader.
KINDS = {
    "bucketed": buckets.load_bucketed,
    "dynamic_batch": buckets.load_dynamic_batch,
    "pipeline": stages.load_pipeline,
    "llm": llm.load_llm,
    tp_llm.KIND: tp_llm.load_llm_tp,
}


def from_artifact(art: Artifact, opts: RuntimeOptions, source: str = "artifact",
                  core=DEFAULT, worker=None, trust_native_code=None) -> Model:
    if not art.built:   # a bad signature is refused whatever the artifact holds
        trust.admit(art, source, trust_native_code)
    kind = art.manifest.get("kind", "model")
    if kind == "model":
        return CompiledModel(art, opts, source=source, core=core, worker=worker)
    if kind not in KINDS:
        raise ArtifactError(f"{source}: artifact kind {kind!r} is not known to this kiln; "
                            "upgrade kiln or recompile the model")
    art.check_host(source)
    return KINDS[kind](art, opts, source, core=core, worker=worker, load_nested=from_artifact)


def load(path_or_bytes, threads: int | None = None, trust_native_code: bool | None = None) -> Model:
    """Load a ``.kiln`` artifact (path or bytes). No model source is needed.

    Partitions that are native code (TorchInductor libraries) load only from
    artifacts signed by this host's key or a key in ``KILN_TRUSTED_KEYS``, or
    with ``trust_native_code=True`` (default: ``KILN_TRUST_NATIVE_CODE=1``);
    otherwise ``UntrustedArtifactError``. A signed artifact whose signature does
    not verify is refused (``SignatureError``). See ``kiln.artifact.trust``."""
    opts = RuntimeOptions(threads=threads)
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        return from_artifact(Artifact.from_bytes(bytes(path_or_bytes)), opts, "<bytes>",
                             trust_native_code=trust_native_code)
    art = Artifact.load(path_or_bytes)
    model = from_artifact(art, opts, source=str(path_or_bytes), trust_native_code=trust_native_code)
    art.release_pages()       # the engines hold what they need; the digest check's pages go
    return model
