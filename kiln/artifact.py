"""The ``.kiln`` artifact: one zip file, a JSON manifest and checksummed blobs.

Layout::

    manifest.json          format/kiln/engine versions, target ISA, options,
                           I/O specs, the host program, blob checksums
    partitions/N.<ext>     one compiled blob per device partition
    host_constants.safetensors   tensors used by host (fallback) ops

Nothing is pickled, so reading an artifact never runs code from it. Writes go
to a temporary file in the destination directory and are renamed into place,
so a killed process never leaves a half-written artifact under the real name.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
import zipfile
import zlib

from . import target as target_mod
from .errors import ArtifactError, TargetMismatchError

FORMAT = "kiln-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Artifact:
    def __init__(self, manifest: dict, blobs: dict):
        self.manifest = manifest
        self.blobs = blobs

    # -- writing ------------------------------------------------------------
    def seal(self):
        """Record each blob's size and checksum in the manifest."""
        self.manifest["blobs"] = {name: {"sha256": sha256(data), "crc32": zlib.crc32(data), "size": len(data)}
                                  for name, data in sorted(self.blobs.items())}
        return self

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        self._write(buf)
        return buf.getvalue()

    def _write(self, f):
        self.seal()
        with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED) as z:
            z.writestr(MANIFEST, json.dumps(self.manifest, indent=1, sort_keys=True))
            for name, data in sorted(self.blobs.items()):
                z.writestr(name, data)

    def save(self, path) -> str:
        path = os.fspath(path)
        write_atomic(path, self._write)
        return path

    # -- reading ------------------------------------------------------------
    @classmethod
    def from_bytes(cls, data: bytes, source: str = "<bytes>") -> "Artifact":
        return cls._read(io.BytesIO(data), source)

    @classmethod
    def load(cls, path) -> "Artifact":
        path = os.fspath(path)
        if not os.path.exists(path):
            raise ArtifactError(f"{path}: no such file")
        with open(path, "rb") as f:
            return cls._read(f, path)

    @classmethod
    def _read(cls, f, source) -> "Artifact":
        try:
            z = zipfile.ZipFile(f)
        except zipfile.BadZipFile:
            raise ArtifactError(f"{source}: not a kiln artifact (not a zip archive, or truncated); "
                                "recompile the model or copy the file again") from None
        with z:
            names = set(z.namelist())
            if MANIFEST not in names:
                raise ArtifactError(f"{source}: zip archive without {MANIFEST}; not a kiln artifact")
            try:
                manifest = json.loads(z.read(MANIFEST))
            except (ValueError, zipfile.BadZipFile, OSError) as e:
                raise ArtifactError(f"{source}: manifest is corrupt ({e}); recompile the model") from None
            if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
                raise ArtifactError(f"{source}: manifest is not a kiln manifest (format "
                                    f"{manifest.get('format') if isinstance(manifest, dict) else '?'!r})")
            version = manifest.get("format_version")
            if not isinstance(version, int) or version > FORMAT_VERSION:
                raise ArtifactError(
                    f"{source}: artifact format {version} was written by kiln "
                    f"{manifest.get('kiln_version', '?')}; this kiln reads format {FORMAT_VERSION} "
                    "and older. Upgrade kiln or recompile the model with this version")
            blobs = {}
            for name, meta in manifest.get("blobs", {}).items():
                if name not in names:
                    raise ArtifactError(f"{source}: blob {name} listed in the manifest is missing; "
                                        "the file is truncated or was edited")
                try:
                    data = z.read(name)
                except (zipfile.BadZipFile, OSError, EOFError) as e:
                    raise ArtifactError(f"{source}: blob {name} cannot be read ({e}); the file is "
                                        "corrupt or truncated") from None
                # zipfile has checked the data against the member's CRC-32 while reading it, so
                # comparing that CRC with the manifest's costs nothing; SHA-256 (ten times slower
                # to compute than reading the file) is the check only for artifacts without crc32.
                if "crc32" in meta:
                    intact = len(data) == meta["size"] and z.getinfo(name).CRC == meta["crc32"]
                else:
                    intact = len(data) == meta["size"] and sha256(data) == meta["sha256"]
                if not intact:
                    raise ArtifactError(f"{source}: checksum mismatch in {name}; the file is corrupt. "
                                        "Recompile the model or copy the file again")
                blobs[name] = data
        return cls(manifest, blobs)

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


def write_atomic(path: str, writer):
    """Call ``writer(file)`` on a temp file beside ``path``, fsync, then rename over ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".kiln-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            writer(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
