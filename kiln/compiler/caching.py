"""The compile cache as a driver hook: look a graph up before compiling it, store it after.

The store itself (keys, entries, locks, eviction) is :mod:`kiln.compiler.cache`; this
module is the policy around one compile, handed to the driver as a
:class:`kiln.compiler.driver.Hook`:

1. the model's *fingerprint* (weights and code, no capture) may alias a known key;
2. else the graph is captured and keyed (:func:`keys.graph_key`), and looked up;
3. else it is compiled under the key's lock (one process compiles, others wait and
   reuse), stored, and the fingerprint aliased to the key.

An alias file is a plain ``{"key": ...}`` anyone with write access to the store can edit,
so it is only a hint: an entry records, in its artifact's signed manifest
(``manifest["cache"]["fingerprint"]``; in the meta of a remembered failure), the
fingerprint of the model it was compiled for, and an alias hit is served only when that
is the fingerprint looked up. An alias naming another model's entry is warned about,
removed and not served (the model is captured and keyed by its graph instead). An entry
reached through its graph key serves any fingerprint, but an alias to it is written only
for the fingerprint it records, so a model whose fingerprint differs from the compiling
one's (its code changed without changing its graph) is captured on each trace to find it.

A failure that comes from the graph and the options is remembered and raised again
from the cache, as its original class (``except CompileError`` still catches it).
"""
from __future__ import annotations

import logging
import time
import warnings

from kiln._version import __version__
from kiln.artifact import trust
from kiln.artifact.container import Artifact
from kiln.compiler import checks, fingerprint, keys
from kiln.compiler.options import lossy
from kiln.errors import (ArtifactError, CompileError, UnsupportedOpError, UntrustedArtifactError,
                         ValidationError, cached_failure)
from kiln.compiler.reuse import capture_for
from kiln.graph.capture import bind_inputs, model_name, positional_count
from kiln.runtime.model import CompiledModel
from kiln.runtime.options import RuntimeOptions

log = logging.getLogger("kiln")

# Failures that come from the graph and the options, so they recur on every machine
# with the same key; a missing engine or a killed process is not remembered.
DETERMINISTIC = (CompileError, UnsupportedOpError, ValidationError)


class CacheHook:
    """Compile through ``store``; ``on_miss(job, captured, key, fingerprint)``, when given,
    replaces compiling on a miss (parallel-compile's collect pass records the job)."""

    def __init__(self, store, retry_failed=False, progress=None, on_miss=None):
        self.store, self.retry_failed, self.progress, self.on_miss = store, retry_failed, progress, on_miss

    def __call__(self, job, compile_):
        if job.calibration:          # static-quantization samples are not part of the key
            return compile_()
        store, progress = self.store, self.progress
        extra = {"name": job.name}
        from_cache = reader(store, self.retry_failed, job.threads)
        with progress.phase("cache lookup"):
            named = bind_inputs(job.model, job.args, job.kwargs)
            fp = fingerprint.fingerprint(job.model, named, job.options, extra)
            key = store.alias(fp) if fp else None
            hit = from_cache(key, fp) if key is not None else None
            hit = hit if hit is None else vouched(store, key, hit, job)
            if hit is not None:
                store.count("alias_hits")
                return _named(hit, job)
        started = time.perf_counter()
        with progress.phase("capture"):
            captured = capture_for(job.model, job.args, job.kwargs)
        captured.capture_seconds = time.perf_counter() - started     # this compile's phases include it
        key = keys.graph_key(captured, job.options, extra)
        hit = from_cache(key)
        hit = hit if hit is None else vouched(store, key, hit, job)
        if hit is None:
            if self.on_miss is not None:
                return self.on_miss(job, captured, key, fp)
            return compile_into(store, key, fp, captured, compile_, job.compiler_args, from_cache, progress)
        _alias_if_served(store, fp, key, hit)
        return _named(hit, job)


def _named(hit, job):
    """``hit`` named as this compile would name it (``name=``, else the model's class): the
    key holds a name given with ``name=``, not the class, so two classes with one graph share
    an entry, and until 12-03 the second got the first one's name (in ``kiln inspect``, the
    server's model metadata, the metrics and messages). The manifest is signed again when
    saved (``kiln.artifact.trust.signature_for``)."""
    want = job.name or model_name(job.model)
    if hit.manifest.get("model_name") != want:
        hit.manifest["model_name"] = want
    return hit


def vouched(store, key, hit, job):
    """``hit``, or None when it must be compiled again. An entry signed by a key this host
    does not trust can only be one without native code (:func:`reader` refuses the others),
    which runs none of its writer's code but computes whatever graph it holds: anyone able
    to write to a shared store could plant one that answers wrongly under a model's key. Such
    a hit is run on this trace's example inputs and held to eager PyTorch as the compile
    was (its tolerances; a lossy build's cosine gate); one that disagrees is discarded and
    compiled here. Entries this host or ``KILN_TRUSTED_KEYS`` signed are served as they are."""
    if trust.trusted_by(hit._artifact, f"cache entry {key[:16]}") is not None:
        return hit
    problem = _against_eager(hit, job)
    if problem is None:
        store.count("checked_hits")
        return hit
    log.warning("kiln cache: entry %s, signed by a key this host does not trust, does not answer as eager "
                "PyTorch does on this trace's inputs (%s); discarding it and compiling here", key[:16], problem)
    store.count("mismatched")
    store.discard(key, ArtifactError(f"it disagrees with eager: {problem}"))
    return None


def _against_eager(hit, job) -> str | None:
    """What is wrong with ``hit``'s outputs against ``job.model``'s on the job's inputs, or None."""
    import torch
    from torch.utils import _pytree
    opts = job.options
    named = bind_inputs(job.model, job.args, job.kwargs)      # the model's own call, for both
    names = list(named)
    n = positional_count(job.model, names)
    args, kwargs = [named[k] for k in names[:n]], {k: named[k] for k in names[n:]}
    def fresh():        # a call that writes an input in place (a decoder's cache) leaves it to itself
        return _pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, (args, kwargs))
    with torch.no_grad():
        a, k = fresh()
        expected = _pytree.tree_leaves(job.model(*a, **k))
        a, k = fresh()
        actual = _pytree.tree_leaves(hit(*a, **k))
    if len(expected) != len(actual):
        return f"{len(actual)} outputs, eager gives {len(expected)}"
    for i, (e, a) in enumerate(zip(expected, actual)):
        if isinstance(e, torch.Tensor) and not isinstance(a, torch.Tensor):
            return f"output {i} is a {type(a).__name__}, eager gives a tensor"
    # the compile's own comparison (shapes, dtypes, integers, NaN, its tolerances); a lossy
    # build is held to the compile's cosine gate besides, as its validation held it
    problem = checks.disagreement(expected, actual, opts)
    if problem is not None or not lossy(opts):
        return None if problem is None else str(problem)
    for i, (e, a) in enumerate(zip(expected, actual)):
        if isinstance(e, torch.Tensor) and e.is_floating_point() and e.numel():
            e64, a64 = e.double().flatten(), a.double().flatten()
            cos = torch.nn.functional.cosine_similarity(e64, a64, dim=0).item() if e64.norm() > 1e-12 else 1.0
            if not cos >= opts.min_cosine:
                return f"output {i}'s cosine similarity is {cos:.4g} (min_cosine {opts.min_cosine:g})"
    return None


def _alias_if_served(store, fp, key, hit):
    """Alias ``fp`` to ``key`` if the entry ``hit`` was read from was compiled for ``fp`` (an
    alias to it would not be served otherwise, see the module doc)."""
    if fp and (hit.manifest.get("cache") or {}).get("fingerprint") == fp:
        store.set_alias(fp, key)


def reader(store, retry_failed, threads):
    """A function key -> loaded model from the cache, or None (then compile); a remembered
    failure raises again unless ``retry_failed``.

    Entries are verified like any artifact, but their native code is trusted only by a
    signature (this host's key or ``KILN_TRUSTED_KEYS``; never ``KILN_TRUST_NATIVE_CODE``):
    anyone who can write to a shared store can replace an entry. An untrusted entry is a
    miss, kept for the hosts that trust it (its key lands in ``from_cache.untrusted``, and
    :func:`compile_into` does not overwrite it); a bad signature is corruption."""
    untrusted: set = set()

    def from_cache(key, fp=None):
        """``fp``: the fingerprint whose alias named ``key``; the entry must record it."""
        found = store.lookup(key)
        if found is None:
            return None
        status, payload, meta = found
        if status == "failed":
            if fp is not None and meta.get("fingerprint") != fp:
                return _misdirected(store, fp, key, meta.get("fingerprint"))
            return _failed(store, key, payload, meta, retry_failed)
        try:
            where = f"cache entry {key[:16]}"
            art = Artifact.load(payload) if isinstance(payload, str) else Artifact.from_bytes(payload, where)
            trust.admit(art, where, trust_native_code=False)
            stored = art.manifest.get("cache") or {}     # signed with the entry (verified above)
            stored_as = stored.get("key")
            if stored_as not in (None, key):    # another entry's artifact, moved or copied here
                raise ArtifactError(f"it holds the artifact compiled for key {str(stored_as)[:16]}")
            if fp is not None and stored.get("fingerprint") != fp:
                return _misdirected(store, fp, key, stored.get("fingerprint"))
            compiled = CompiledModel(art, RuntimeOptions(threads=threads), source=where)
            art.release_pages()
        except UntrustedArtifactError as e:
            if key not in untrusted:
                untrusted.add(key)
                store.count("untrusted")
                log.warning("kiln cache: not loading entry %s, compiling instead: %s", key[:16], e)
            return None
        except ArtifactError as e:   # a corrupt entry; a missing engine or bad setting is no reason to drop it
            store.discard(key, e)
            return None
        except OSError as e:         # a local entry there but unreadable (permissions, a flaky mount)
            store.unusable("reading", e)
            return None
        store.touch(key, meta)
        store.count("hits")
        compiled.manifest["cache"] = {"key": key, "url": store.url, "hit": True,
                                      "fingerprint": stored.get("fingerprint")}
        precision = compiled.manifest.get("precision") or {}
        if precision.get("emulated"):    # as the compile warned: slower than fp32, not faster
            warnings.warn(f"kiln: {precision.get('note')}", stacklevel=5)
        return compiled

    from_cache.untrusted = untrusted
    return from_cache


def _misdirected(store, fp, key, recorded):
    """An alias names an entry compiled for another model (the alias file was edited, or
    the entry was evicted and compiled again for a model with another fingerprint): serving
    it would answer with another model's artifact. It is removed; the caller captures."""
    log.warning("kiln cache %s: the alias of fingerprint %s names entry %s, which was compiled for "
                "%s; not serving it (it would compute another model), removing the alias and "
                "capturing the model to find its own entry", store.url, fp[:16], key[:16],
                f"fingerprint {str(recorded)[:16]}" if recorded else "no recorded fingerprint")
    store.drop_alias(fp)
    return None


def _failed(store, key, payload, meta, retry_failed):
    if retry_failed:
        store.forget(key)
        return None
    store.count("failed_hits")
    error = str(meta.get("error") or "")
    raise cached_failure(
        error.partition(":")[0],
        f"{meta.get('model_name', 'this model')} failed to compile on {meta.get('created', '?')[:19]} "
        f"with these options (cache key {key[:16]}): {payload}\nkiln does not retry known "
        "failures; pass retry_failed=True (kiln compile --retry-failed) to try again")


def compile_into(store, key, fp, captured, compile_, compiler_args, from_cache, progress=None):
    """Compile ``key`` once across processes: under its lock, unless another process
    stores it meanwhile (then that result is used; the wait shows on ``progress``), and
    remember deterministic failures."""
    with store.lock(key, wait_for=lambda: from_cache(key), progress=progress) as ready:
        hit = ready or from_cache(key)
        if hit is not None:
            _alias_if_served(store, fp, key, hit)
            return hit
        store.count("misses")
        store.count("compiles")
        info = {"model_name": captured.model_name, "kiln_version": __version__,
                "options": compiler_args if isinstance(compiler_args, str) else " ".join(compiler_args or [])}
        try:
            compiled = compile_(captured)
        except DETERMINISTIC as e:
            store.store_failure(key, e, dict(info, fingerprint=fp))
            raise
        # Signed with the artifact: the fingerprint is what an alias to this entry must name.
        compiled.manifest["cache"] = {"key": key, "url": store.url, "hit": False, "fingerprint": fp}
        engines = sorted({p["engine"] for p in compiled.manifest["partitions"]})
        if key in getattr(from_cache, "untrusted", ()):
            log.info("kiln cache: keeping entry %s (signed by a key this host does not trust) "
                     "for the hosts that trust it", key[:16])
        elif store.store(key, compiled.to_bytes(), dict(info, engine=",".join(engines) or "host")) is None:
            compiled.manifest["cache"]["stored"] = False   # the store warned; no alias to an absent entry
            return compiled
        if fp:
            store.set_alias(fp, key)
        return compiled
