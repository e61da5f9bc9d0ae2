"""The ``.kiln`` artifact: one zip file, a JSON manifest and checksummed blobs.

Layout::

    manifest.json          format/kiln/engine versions, target ISA, options,
                           I/O specs, the host program, blob checksums
    signature.json         Ed25519 signature over the manifest (kiln.artifact.trust)
    partitions/N.<ext>     one compiled blob per device partition
    host_constants.safetensors   tensors used by host (fallback) ops

Nothing is pickled, so reading an artifact never runs code from it; loading
runs native code (TorchInductor libraries) only from artifacts ``kiln.artifact.trust``
admits. This module stores and reads the signature member; kiln.artifact.trust signs
and judges it. Writes go
to a temporary file in the destination directory and are renamed into place,
so a killed process never leaves a half-written artifact under the real name.

Reading maps the file instead of copying it: members are stored uncompressed,
so each blob is a read-only view into the mapping, checked against the
manifest's chunked XXH3-128 digest (tens of GB/s on a few threads, where
CRC-32 and SHA-256 manage one or two). An engine that can read weights where they lie (ONNX Runtime's
external data) then loads hundreds of megabytes without a copy.
Because kiln replaces files by rename, a mapping stays valid while a newer
artifact is written over the same name.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import mmap
import os
import struct
import zipfile
import zlib

import xxhash

from kiln.artifact import schema
from kiln.atomic import write_atomic

from kiln.host import target as target_mod
from kiln.artifact.zipview import ViewFile as _ViewFile, ends_with_directory as _ends_with_directory
from kiln.errors import ArtifactError, TargetMismatchError

FORMAT = "kiln-artifact"
# 2 (11-29): an Inductor partition may expect its inputs in a layout it records (a transposed
# weight as it is, kiln.engines.inductor); a format-1 reader would hand it contiguous copies
# and get wrong answers, so it refuses these artifacts instead. Format 1 still loads.
FORMAT_VERSION = 2
# 3 (11-29): graphs that read members of the artifact enclosing them (``shared_blobs``: the
# weights their ONNX Runtime partitions have in common, kiln.runtime.ort_pool). Written only
# where that is so; a format-2 reader refuses these instead of failing on the missing weights.
POOLED_FORMAT = 3
READS_FORMAT = POOLED_FORMAT    # the newest format this kiln reads
MANIFEST = "manifest.json"
SIGNATURE = "signature.json"   # kiln.artifact.trust: who signed the manifest (absent: unsigned)
MAX_SIGNATURE = 64 << 10
MAX_MANIFEST = 64 << 20       # a manifest is JSON of a few MB at most (an LLM's holds every graph's)
MAX_INFLATED = 256 << 20      # a compressed member (kiln writes none) inflates to no more than this
ALIGN = 4096          # blob data starts on a page boundary, so engines can map it


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where a blob's bytes lie in a file, for engines that map weights from files
    (ONNX Runtime's external data) instead of copying them."""
    path: str
    offset: int
    dev: int
    ino: int

    def unchanged(self) -> bool:
        """The path still names the file that was mapped (kiln replaces files by
        rename, so a newer artifact under the same name is a different inode)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == (self.dev, self.ino)

    def map_private(self, length: int):
        """The blob's ``length`` bytes mapped again from this file, privately and
        copy-on-write (writable, and no write reaches the file), or None when the path no
        longer names the file the artifact was read from (kiln writes by rename, so the
        same device and inode mean the same bytes). For engines that import from memory
        they may keep but only take writable (OpenVINO's shared tensors)."""
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if (st.st_dev, st.st_ino) != (self.dev, self.ino) or length <= 0:
                    return None
                return mmap.mmap(f.fileno(), length, access=mmap.ACCESS_COPY, offset=self.offset)
        except (OSError, ValueError):
            return None


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


CHUNK = 32 << 20
_pool = None


def xxh3_chunked(data) -> str:
    """The blob check read at load: XXH3-128 over the XXH3-128 digests of 32 MiB chunks,
    hashed on several threads (xxhash drops the GIL), so 800 MB verify in about 40 ms
    on two cores instead of 80."""
    global _pool
    view = memoryview(data).cast("B")
    chunks = [view[i:i + CHUNK] for i in range(0, len(view), CHUNK)] or [view]
    if len(chunks) == 1:
        digests = [xxhash.xxh3_128_digest(chunks[0])]
    else:
        if _pool is None:
            from concurrent.futures import ThreadPoolExecutor
            _pool = ThreadPoolExecutor(max(1, min(4, len(os.sched_getaffinity(0)))),
                                       thread_name_prefix="kiln-verify")
        digests = list(_pool.map(xxhash.xxh3_128_digest, chunks))
    return xxhash.xxh3_128_hexdigest(b"".join(digests))


class Artifact:
    def __init__(self, manifest: dict, blobs: dict, file=None, offsets=None, signature=None,
                 built=True):
        self.manifest = manifest
        self.blobs = blobs
        # kiln.artifact.trust's state: ``built`` is False for artifacts read from a file or bytes,
        # whose ``signature.json`` (bytes) is kept as read; ``parent`` is (enclosing
        # artifact, blob name) for nested ones; ``verdict`` is what loading found.
        self.signature = signature
        self.built = built
        self.parent = None
        self.verdict = None
        self._file = file                 # (path, dev, ino, base offset) when mapped from a file
        self._offsets = offsets or {}     # blob name -> offset of its data in this artifact
        self._mapping = None              # the file's mmap, when this artifact was read from one

    def origin(self, name) -> Origin | None:
        """The file span holding blob ``name``, when this artifact was mapped from a file."""
        if self._file is None or name not in self._offsets:
            return None
        path, dev, ino, base = self._file
        return Origin(path, base + self._offsets[name], dev, ino)

    def shared(self, name):
        """``(data, origin)`` of member ``name`` of this artifact or of the nearest enclosing
        one that has it: what a graph's ``shared_blobs`` name (weights stored once for all
        the graphs of an LLM, :mod:`kiln.runtime.ort_pool`); None where none has it."""
        art = self
        while art is not None:
            if name in art.blobs:
                return art.blobs[name], art.origin(name)
            art = art.parent[0] if art.parent else None
        return None

    def self_contained(self) -> "Artifact":
        """This artifact with the members its manifest's ``shared_blobs`` names copied in
        from the artifact that enclosed it, so that it loads on its own (a graph saved or
        sent apart from its LLM); itself when it holds them already."""
        missing = [n for n in self.manifest.get("shared_blobs", []) if n not in self.blobs]
        if not missing:
            return self
        blobs = dict(self.blobs)
        for name in missing:
            found = self.shared(name)
            if found is None:
                raise ArtifactError(f"the artifact reads {name} from the artifact that held it, "
                                    "which is not at hand: save the whole model (the LLM, the bucketed model) instead")
            blobs[name] = found[0]
        return Artifact(dict(self.manifest), blobs)

    def nested(self, name, source) -> "Artifact":
        """The artifact stored as blob ``name`` (buckets, pipeline stages), still mapped."""
        if name not in self.blobs:
            raise ArtifactError(f"{source}: the nested artifact is missing; the file is corrupt "
                                "or was edited")
        file = None
        if self._file is not None and name in self._offsets:
            path, dev, ino, base = self._file
            file = (path, dev, ino, base + self._offsets[name])
        # its bytes were checked as this artifact's blob: hashing its blobs again is waste
        inner = Artifact._read(memoryview(self.blobs[name]).cast("B"), source, file, verify=False)
        inner.parent = (self, name)
        return inner

    def release_pages(self):
        """Drop this process's page mappings of the artifact's file once its models are
        loaded; the blobs stay readable (a later read maps the pages again from the page
        cache, or the file).

        Why: loading checks every blob's digest through the file's mapping, which leaves
        every page of the file mapped into the process, while the engines map or copy what
        they keep for themselves. The idle mapping made a served int8 SmolLM2 show 2.4 GiB of
        resident memory for an 1.1 GB file, and kept pages the kernel could otherwise drop
        under memory pressure counted against the process. The mapping is shared and
        read-only, so ``MADV_DONTNEED`` only unmaps: nothing is lost."""
        mapping = self._mapping
        if mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        try:
            mapping.madvise(mmap.MADV_DONTNEED)
        except (OSError, ValueError):     # closed, or a kernel that refuses: only memory is at stake
            pass

    # -- writing ------------------------------------------------------------
    def seal(self):
        """Record each blob's size and checksum in the manifest."""
        # sha256 is the blob's identity; crc32 and xxh3c are what older and current
        # readers check at load.
        self.manifest["blobs"] = {name: {"sha256": sha256(data), "crc32": zlib.crc32(data),
                                         "xxh3c": xxh3_chunked(data), "size": len(data)}
                                  for name, data in sorted(self.blobs.items())}
        return self

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        self._write(buf)
        return buf.getvalue()

    def _write(self, f):
        from kiln.artifact.trust import signature_for
        self.seal()
        if SIGNATURE in self.blobs:
            raise ArtifactError(f"a blob may not be named {SIGNATURE}")
        signature = signature_for(self)
        with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED) as z:
            z.writestr(MANIFEST, json.dumps(self.manifest, indent=1, sort_keys=True))
            if signature is not None:
                z.writestr(SIGNATURE, signature)
            for name, data in sorted(self.blobs.items()):
                info = zipfile.ZipInfo(name)
                # An extra field of padding puts the data on an ALIGN boundary (0xD935
                # is the id zipalign uses for the same purpose).
                start = z.fp.tell() + 30 + len(name.encode()) + 4
                pad = (-start) % ALIGN
                info.extra = struct.pack("<HH", 0xD935, pad) + bytes(pad)
                z.writestr(info, data)

    def save(self, path) -> str:
        path = os.fspath(path)
        write_atomic(path, self._write)
        return path

    def write_to(self, f):
        """Serialize into the open binary file ``f`` as it goes (no copy in memory; not atomic:
        :meth:`save` is, for a path)."""
        self._write(f)

    # -- reading ------------------------------------------------------------
    @classmethod
    def from_bytes(cls, data, source: str = "<bytes>") -> "Artifact":
        """Parse an artifact held in memory (bytes, or a view into a mapped file)."""
        return cls._read(memoryview(data).cast("B"), source)

    @classmethod
    def load(cls, path) -> "Artifact":
        path = os.fspath(path)
        if not os.path.exists(path):
            raise ArtifactError(f"{path}: no such file")
        if os.path.isdir(path):
            inside = [n for n in ("model.kiln", "encoder/model.kiln") if os.path.isfile(os.path.join(path, n))]
            raise ArtifactError(f"{path} is a directory, not a kiln artifact file" + (
                f": it holds {os.path.join(path, inside[0])} (an Optimum-style export: load that file, or the "
                "directory with kiln.optimum.neuron's from_pretrained)" if inside else ""))
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_size == 0:
                raise ArtifactError(f"{path}: empty file; not a kiln artifact")
            try:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError):   # a filesystem that cannot map: read it
                return cls._read(memoryview(f.read()), path)
        art = cls._read(memoryview(mapped), path, (os.path.realpath(path), st.st_dev, st.st_ino, 0))
        art._mapping = mapped
        return art

    @classmethod
    def _read(cls, view: memoryview, source, file=None, verify=True) -> "Artifact":
        if not _ends_with_directory(view):
            # zipfile would take the last end-of-directory record it finds, and a truncated
            # artifact still holds those of its nested artifacts: it would load one of them
            raise ArtifactError(f"{source}: not a kiln artifact (no zip directory at its end: "
                                "truncated, or not a zip archive); recompile the model or copy "
                                "the file again")
        try:
            z = zipfile.ZipFile(_ViewFile(view))
        except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError):  # (a newer zip version)
            raise ArtifactError(f"{source}: not a kiln artifact (not a zip archive, or truncated); "
                                "recompile the model or copy the file again") from None
        with z:
            names = set(z.namelist())
            if MANIFEST not in names:
                if any(n.endswith("/constants.pkl") or "/code/" in n for n in names):
                    # torch.jit.save's archive: what a Neuron spelling's model.save(path) writes
                    raise ArtifactError(f"{source}: a TorchScript archive (torch.jit.save's file), not a kiln "
                                        "artifact; load it with torch.jit.load after import kiln, or save "
                                        "the model to a path ending in .kiln for kiln.load")
                if any(n.endswith("/data.pkl") for n in names):     # until 12-03 called TorchScript too
                    raise ArtifactError(f"{source}: a torch.save file (a state_dict or pickled objects), not a "
                                        "kiln artifact; load it with torch.load, and compile the model with "
                                        "kiln.trace to get an artifact for kiln.load")
                raise ArtifactError(f"{source}: zip archive without {MANIFEST}; not a kiln artifact")
            try:
                manifest = json.loads(read_bounded(z, z.getinfo(MANIFEST), MAX_MANIFEST))
            # NotImplementedError, RuntimeError: a compression method or encryption zipfile
            # cannot read; RecursionError: JSON nested too deep to parse
            except (ValueError, zipfile.BadZipFile, OSError, EOFError, NotImplementedError,
                    RuntimeError, RecursionError) as e:
                raise ArtifactError(f"{source}: manifest is corrupt ({e}); recompile the model") from None
            if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
                raise ArtifactError(f"{source}: manifest is not a kiln manifest (format "
                                    f"{manifest.get('format') if isinstance(manifest, dict) else '?'!r})")
            version = manifest.get("format_version")
            if not isinstance(version, int) or version > READS_FORMAT:
                raise ArtifactError(
                    f"{source}: artifact format {version} was written by kiln "
                    f"{manifest.get('kiln_version', '?')}; this kiln reads format {READS_FORMAT} "
                    "and older. Upgrade kiln or recompile the model with this version")
            schema.check_container(manifest, source)
            signature = None
            if SIGNATURE in names:
                try:
                    info = z.getinfo(SIGNATURE)
                    signature = read_bounded(z, info, MAX_SIGNATURE)
                except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError,
                        RuntimeError) as e:
                    raise ArtifactError(f"{source}: {SIGNATURE} cannot be read ({e}); the file is "
                                        "corrupt or was edited") from None
            blobs, offsets = {}, {}
            for name, meta in manifest.get("blobs", {}).items():
                if name not in names:
                    raise ArtifactError(f"{source}: blob {name} listed in the manifest is missing; "
                                        "the file is truncated or was edited")
                info = z.getinfo(name)
                if info.file_size != meta["size"]:     # before reading anything: a zip bomb declares GBs
                    raise ArtifactError(f"{source}: blob {name} is {info.file_size} bytes in the archive but "
                                        f"the manifest records {meta['size']}; the file is corrupt or was edited")
                try:
                    data, offsets[name] = _member(view, z, info)
                except (zipfile.BadZipFile, OSError, EOFError, ValueError, struct.error,
                        NotImplementedError, RuntimeError) as e:
                    raise ArtifactError(f"{source}: blob {name} cannot be read ({e}); the file is "
                                        "corrupt or truncated") from None
                if not _intact(data, meta, z.getinfo(name), verify):
                    raise ArtifactError(f"{source}: checksum mismatch in {name}; the file is corrupt. "
                                        "Recompile the model or copy the file again")
                blobs[name] = data
        offsets = {k: v for k, v in offsets.items() if v is not None}
        return cls(manifest, blobs, file, offsets, signature, built=False)

    def check_host(self, source: str = "artifact"):
        """Refuse artifacts built for CPU features this host lacks."""
        tgt = self.manifest.get("target", {})
        wrong_arch, missing = target_mod.missing_features(tgt)
        if wrong_arch:
            raise TargetMismatchError(f"{source} was compiled for {wrong_arch}, this host is "
                                      f"{target_mod.arch()}; recompile it on this architecture")
        if missing:
            raise TargetMismatchError(
                f"{source} was compiled for CPU features this host lacks: {', '.join(missing)}. "
                "Recompile on this host, or compile with --target generic for a portable artifact")
        gpu = target_mod.missing_device(tgt)
        if gpu:
            raise TargetMismatchError(f"{source} cannot run here: {gpu}")


def _member(view: memoryview, z: zipfile.ZipFile, info: zipfile.ZipInfo):
    """(data, offset): a stored member as a view into ``view`` (no copy) and where it
    starts; other members are read out (offset None)."""
    if info.compress_type != zipfile.ZIP_STORED:      # not written by kiln; zipfile checks its CRC
        return read_bounded(z, info, MAX_INFLATED), None
    header = bytes(view[info.header_offset:info.header_offset + 30])
    if len(header) < 30 or header[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile("bad local file header")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    start = info.header_offset + 30 + name_len + extra_len
    if start + info.file_size > len(view):
        raise EOFError("member extends past the end of the file")
    return view[start:start + info.file_size], start


def read_bounded(z: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int) -> bytes:
    """A member's bytes; a ValueError naming the member and the sizes if it declares more than
    ``limit`` or inflates to other than it declares: a zip bomb costs at most ``limit`` + 1 bytes."""
    if info.file_size > limit:
        raise ValueError(f"member {info.filename} declares {info.file_size} bytes uncompressed "
                         f"({info.compress_size} stored), over the {limit} allowed")
    with z.open(info) as f:
        data = f.read(info.file_size + 1)      # never more, whatever the stream holds
    if len(data) != info.file_size:
        raise ValueError(f"member {info.filename} inflates to {len(data)} bytes, not the {info.file_size} it declares")
    return data


def _intact(data, meta: dict, info: zipfile.ZipInfo, verify=True) -> bool:
    """Check a blob against the strongest fast digest its manifest has (older
    artifacts carry only crc32 or sha256); only its size unless ``verify``."""
    if len(data) != meta.get("size"):
        return False
    if not verify:
        return True
    if "xxh3c" in meta:
        return xxh3_chunked(data) == meta["xxh3c"]
    if "crc32" not in meta:
        return sha256(data) == meta["sha256"]
    # zipfile checked a member it read out against the zip's CRC; a view was not checked
    crc = zlib.crc32(data) if isinstance(data, memoryview) else info.CRC
    return crc == meta["crc32"]


def manifest_of(path: str) -> dict:
    """An artifact's manifest (and a quick check that it is one), without loading it."""
    if not os.path.exists(path):
        raise ArtifactError(f"{path}: no such file")
    try:
        with zipfile.ZipFile(path) as z:
            manifest = json.loads(read_bounded(z, z.getinfo(MANIFEST), MAX_MANIFEST))
    except (zipfile.BadZipFile, KeyError, ValueError, OSError, EOFError, NotImplementedError, RuntimeError) as e:
        raise ArtifactError(f"{path}: not a kiln artifact ({e})") from None
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{path}: not a kiln artifact (its manifest is not an object)")
    return manifest


# Artifacts of a language model (kiln.runtime.llm, kiln.runtime.tp_llm): graphs with a KV
# cache behind a scheduler, not one model of tensors in and tensors out.
LLM_KINDS = ("llm", "llm_tp")


def refuse_llm(path, what: str):
    """Raise a clear error when ``path`` is an LLM artifact, which ``what`` (a command that
    calls a model on tensors) cannot run; nothing is loaded to find out."""
    if isinstance(path, (str, os.PathLike)) and manifest_of(os.fspath(path)).get("kind") in LLM_KINDS:
        raise ArtifactError(
            f"{path} is an LLM artifact (prefill and decode graphs with a KV cache), which {what} "
            f"cannot call as one model: generate with `kiln llm generate {path} PROMPT`, serve it "
            f"with `kiln serve {path}` (OpenAI API), or measure it with benchmarks/llm.py")


def wrapper_manifest(kind, inner_manifest, **fields):
    """The manifest of an artifact that wraps others (buckets, dynamic batch, pipeline
    stages): the inner model's I/O and target, under the wrapper's ``kind``."""
    from kiln._version import __version__
    m = {"format": FORMAT, "format_version": FORMAT_VERSION, "kiln_version": __version__,
         "kind": kind, "model_name": inner_manifest.get("model_name", "model"),
         "target": inner_manifest.get("target", {}),
         "inputs": inner_manifest["inputs"], "outputs": inner_manifest["outputs"],
         "report": inner_manifest.get("report")}
    m.update(fields)
    return m
