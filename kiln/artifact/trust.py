"""Trust: who signed an artifact, and whether its native code may load here.

Most of an artifact is data: ONNX graphs and OpenVINO IR that their engines
parse, safetensors tensors, the JSON manifest and host program. A TorchInductor
partition is not: it is a shared library, and loading it runs its code. So
kiln signs what it writes and loads native code only from artifacts it trusts.

* **What is signed.** ``signature.json`` beside ``manifest.json`` holds an
  Ed25519 signature over ``message(manifest)``: a context line, then the
  manifest as a reader parses it, re-serialised as compact JSON with sorted
  keys. The manifest's ``blobs`` entry records every blob's size and SHA-256,
  so the signature covers every blob, and nested artifacts (bucket variants,
  the dynamic-batch inner model, pipeline stages, all blobs themselves) with
  everything inside them.
* **Keys.** This host's key is made on first need in the config directory
  (``KILN_CONFIG_DIR``, else ``$XDG_CONFIG_HOME/kiln``, else ``~/.config/kiln``):
  ``signing_key`` (PKCS#8 PEM, mode 0600) and ``signing_key.pub`` (the public
  key in base64, for other hosts). Trusted signers are this host's key and the
  entries of ``KILN_TRUSTED_KEYS``, ``os.pathsep``-separated, each a public key
  (base64 or hex of its 32 bytes) or a file of them, one per line (``#``
  comments).
* **Loading.** A signature that does not verify is refused whatever the
  artifact holds (``SignatureError``). A native-code partition loads when the
  artifact was compiled in this process; or it is signed by a trusted key; or
  it is nested in one that is (the enclosing manifest's SHA-256 of the nested
  bytes is checked); or the caller passed ``trust_native_code=True``
  (``KILN_TRUST_NATIVE_CODE=1``), which extends to the artifacts nested in it.
  Signed native blobs are checked against their SHA-256 before loading (the
  XXH3 check every blob gets tells corruption, not forgery). Otherwise
  ``UntrustedArtifactError``.
* **Writing.** An artifact read from a file and unchanged is written back with
  its own signature. Anything else is signed with this host's key when this
  host trusts all the native code in it without the caller's say-so (compiled
  here, or admitted by a trusted signature), and written unsigned otherwise:
  re-saving a model loaded with ``trust_native_code=True`` does not make this
  host vouch for it.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import json
import logging
import os
import uuid

from kiln.errors import ArtifactError, KilnError, SignatureError, UntrustedArtifactError
from kiln import config

log = logging.getLogger("kiln")

SIGNATURE = "signature.json"
ALGORITHM = "ed25519"
CONTEXT = b"kiln-manifest-signature-v1\n"
PRIVATE_KEY = "signing_key"
PUBLIC_KEY = "signing_key.pub"
_warned: set = set()


def config_dir() -> str:
    explicit = config.get("KILN_CONFIG_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "kiln")


def env_grants() -> bool:
    """``KILN_TRUST_NATIVE_CODE=1``: this process trusts native code in every artifact it loads."""
    return config.flag("KILN_TRUST_NATIVE_CODE")


# -- keys -------------------------------------------------------------------------------------
def fingerprint(public_key: bytes) -> str:
    return "ed25519:" + hashlib.sha256(public_key).hexdigest()[:16]


def encode_key(public_key: bytes) -> str:
    return base64.b64encode(public_key).decode()


def parse_key(text: str) -> bytes | None:
    """A raw Ed25519 public key from base64 or hex text, or None."""
    text = text.strip()
    try:
        raw = bytes.fromhex(text) if len(text) == 64 else base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw if len(raw) == 32 else None


def _public_bytes(key) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _read_private(path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    with open(path, "rb") as f:
        data = f.read()
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        key = e
    if not isinstance(key, Ed25519PrivateKey):
        raise KilnError(f"kiln signing key {path} is not an unencrypted Ed25519 PEM key ({key}); "
                        "move it away to have a new one made (artifacts signed with the old one "
                        "are then no longer trusted here)")
    return key


def host_key(create: bool = True):
    """This host's private key, made on first need (None if absent and not ``create``)."""
    path = os.path.join(config_dir(), PRIVATE_KEY)
    try:
        return _read_private(path)
    except FileNotFoundError:
        if not create:
            return None
    return _create(path)


def _create(path):
    """Make the key; of processes racing to make it, the first link wins and all use it."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from kiln.atomic import write_atomic
    pem = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    write_atomic(tmp, lambda f: f.write(pem))    # a mkstemp file: mode 0600 from the start
    try:
        os.chmod(tmp, 0o600)
        os.link(tmp, path)                       # fails if another process made one meanwhile
    except FileExistsError:
        pass
    except OSError:                              # no hard links on this filesystem
        os.replace(tmp, path)
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass
    key = _read_private(path)
    public = (encode_key(_public_bytes(key)) + "\n").encode()
    write_atomic(os.path.join(directory, PUBLIC_KEY), lambda f: f.write(public))
    os.chmod(os.path.join(directory, PUBLIC_KEY), 0o644)
    log.info("kiln: made this host's artifact signing key %s (%s)", path, fingerprint(_public_bytes(key)))
    return key


def host_public_key() -> bytes | None:
    key = host_key(create=False)
    return None if key is None else _public_bytes(key)


def trusted_keys() -> dict:
    """Raw public key -> why it is trusted: this host's key and ``KILN_TRUSTED_KEYS``."""
    keys = {}
    for entry in config.get("KILN_TRUSTED_KEYS").split(os.pathsep):
        entry = entry.strip()
        if entry:
            for raw in _entry_keys(entry):
                keys[raw] = "KILN_TRUSTED_KEYS"
    try:
        own = host_public_key()
    except OSError as e:           # unreadable: this host then trusts only KILN_TRUSTED_KEYS
        log.debug("kiln: cannot read this host's signing key: %s", e)
        own = None
    if own is not None:
        keys[own] = "this host's key"
    return keys


def _entry_keys(entry) -> list:
    if os.path.isfile(entry):
        with open(entry, encoding="utf-8", errors="replace") as f:
            lines = [line.split("#", 1)[0].strip() for line in f]
        keys = [parse_key(line) for line in lines if line]
        if keys and None not in keys:
            return keys
        raise KilnError(f"KILN_TRUSTED_KEYS: {entry} should hold Ed25519 public keys, one per line "
                        "in base64 or hex (as in a signing_key.pub)")
    raw = parse_key(entry)
    if raw is None:
        raise KilnError(f"KILN_TRUSTED_KEYS: {entry!r} is neither a file of public keys nor an "
                        "Ed25519 public key in base64 or hex")
    return [raw]


# -- signing and verifying ------------------------------------------------------------------------
def message(manifest: dict) -> bytes:
    """The signed bytes: the manifest as a reader parses it, as compact sorted JSON."""
    parsed = json.loads(json.dumps(manifest, sort_keys=True))   # tuples, non-string keys as written
    return CONTEXT + json.dumps(parsed, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign(manifest: dict) -> bytes | None:
    """``signature.json`` for ``manifest`` with this host's key (None if no key can be made)."""
    try:
        key = host_key()
    except OSError as e:
        where = config_dir()
        if where not in _warned:
            _warned.add(where)
            log.warning("kiln: cannot make a signing key in %s (%s); artifacts are written unsigned, "
                        "and their native code will not load without trust_native_code=True. Set "
                        "KILN_CONFIG_DIR to a writable directory", where, e)
        return None
    record = {"version": 1, "algorithm": ALGORITHM, "public_key": encode_key(_public_bytes(key)),
              "signature": base64.b64encode(key.sign(message(manifest))).decode()}
    return json.dumps(record, indent=1).encode()


def verify(manifest: dict, record: bytes, source: str) -> bytes:
    """The signer's public key; SignatureError when ``record`` does not sign ``manifest``."""
    try:
        rec = json.loads(record)
        algorithm = rec["algorithm"]
        public = base64.b64decode(rec["public_key"], validate=True)
        signature = base64.b64decode(rec["signature"], validate=True)
    except (ValueError, KeyError, TypeError, binascii.Error):
        raise SignatureError(f"{source}: {SIGNATURE} is malformed; the file is corrupt or was edited. "
                             "Recompile the model or copy the original file again") from None
    if algorithm != ALGORITHM:
        raise SignatureError(f"{source}: signed with {algorithm!r}; this kiln verifies {ALGORITHM} "
                             "signatures only")
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, message(manifest))
    except (InvalidSignature, ValueError):
        raise SignatureError(
            f"{source}: the signature (by {fingerprint(public)}) does not match the manifest: the "
            "file was modified after it was signed. kiln refuses it; recompile the model or copy "
            "the original file again") from None
    return public


# -- the decision -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Verdict:
    """What loading found out about one artifact read from a file or bytes."""
    signer: bytes | None            # the verified signer's public key (None: unsigned)
    granted: bool                   # the caller trusts its native code (trust_native_code)
    vouched: bool | None = None     # nested: its bytes match the enclosing signed manifest
    checked: set = dataclasses.field(default_factory=set)   # native blobs matched to their SHA-256


def admit(art, source: str, trust_native_code: bool | None = None) -> Verdict:
    """Verify ``art``'s signature (SignatureError if it does not) and record the caller's
    grant; nested artifacts inherit their enclosing artifact's grant."""
    if trust_native_code is None:
        trust_native_code = env_grants()
    parent = art.parent[0] if art.parent else None
    inherited = parent is not None and parent.verdict is not None and parent.verdict.granted
    signer = verify(art.manifest, art.signature, source) if art.signature is not None else None
    art.verdict = Verdict(signer, bool(trust_native_code) or inherited)
    return art.verdict


def _signed_by_trusted(art, source) -> str | None:
    v = art.verdict or admit(art, source)
    if v.signer is None:
        return None
    who = trusted_keys().get(v.signer)
    return f"signed by {who} {fingerprint(v.signer)}" if who else None


def trusted_by(art, source: str = "artifact") -> str | None:
    """Why native code in ``art`` may load without the caller's grant, or None."""
    if art.built:
        return "compiled in this process"
    why = _signed_by_trusted(art, source)
    if why or art.parent is None:
        return why
    parent, name = art.parent
    outer = trusted_by(parent, source)
    if outer is None:
        return None
    v = art.verdict
    if v.vouched is None:
        expected = (parent.manifest.get("blobs", {}).get(name) or {}).get("sha256")
        v.vouched = expected == hashlib.sha256(parent.blobs[name]).hexdigest()
    if not v.vouched:
        raise SignatureError(f"{source}: the nested artifact does not match the SHA-256 its enclosing "
                             "artifact's signed manifest records; the file was modified after it was signed")
    return f"covered by the enclosing artifact's signature ({outer})"


def require(art, partitions: list, source: str):
    """Raise UntrustedArtifactError unless the native-code ``partitions`` of ``art`` may load."""
    if art.built:
        return
    v = art.verdict or admit(art, source)
    if v.granted:
        return
    if trusted_by(art, source) is None:
        raise UntrustedArtifactError(_refusal(art, partitions, source))
    for p in partitions:
        name = p["blob"]
        if name in v.checked:
            continue
        expected = (art.manifest.get("blobs", {}).get(name) or {}).get("sha256")
        if expected != hashlib.sha256(art.blobs[name]).hexdigest():
            raise SignatureError(f"{source}: partition {p['id']} ({name}) does not match the SHA-256 "
                                 "its signed manifest records; the file was modified after it was signed")
        v.checked.add(name)


def _refusal(art, partitions, source) -> str:
    v = art.verdict
    which = ", ".join(f"partition {p['id']} (engine {p['engine']})" for p in partitions)
    if v.signer is None:
        who, fix = "unsigned", ""
    else:
        who = f"signed by {fingerprint(v.signer)}, a key this host does not trust"
        fix = f", or add the signer's public key {encode_key(v.signer)} to KILN_TRUSTED_KEYS"
    return (f"{source}: {which} is native code (a shared library that loading would run), and the "
            f"artifact is {who}. kiln loads native code only from artifacts compiled in this process "
            "or signed by this host's key or a key in KILN_TRUSTED_KEYS. If you trust whoever built it, "
            "load it with kiln.load(..., trust_native_code=True) (--trust-native-code on the command "
            f"line, KILN_TRUST_NATIVE_CODE=1 for a process){fix}; or recompile the model here")


def holds_native(art) -> bool:
    """Whether ``art`` or an artifact nested in it has a native-code partition."""
    from kiln import engines
    try:
        if any(engines.native_code(p["engine"]) for p in art.manifest.get("partitions") or ()):
            return True
        return any(holds_native(art.nested(n, n)) for n in art.blobs if n.endswith(".kiln"))
    except (ArtifactError, KeyError, TypeError, AttributeError):
        return True     # unreadable: assume the worst


def signature_for(art) -> bytes | None:
    """The ``signature.json`` to write with ``art`` (sealed), or None to write it unsigned."""
    if art.signature is not None:
        try:
            verify(art.manifest, art.signature, "artifact")
            return art.signature          # read from a file and unchanged: keep its signer
        except SignatureError:
            pass
    return sign(art.manifest) if _may_sign(art) else None


def _may_sign(art) -> bool:
    """This host vouches only for native code it trusts without the caller's say-so."""
    if not art.built:
        return not holds_native(art) or trusted_by(art) is not None
    # Compiled or wrapped in this process: its own partitions were compiled here, and a
    # nested artifact comes from a model this process holds, written under this same rule.
    for name in art.blobs:
        if not name.endswith(".kiln"):
            continue
        try:
            inner = art.nested(name, name)
        except ArtifactError:
            return False
        try:
            if _signed_by_trusted(inner, name) is not None:
                continue
        except SignatureError:
            pass
        if holds_native(inner):
            return False
    return True


def describe(art, source: str) -> dict:
    """For ``kiln inspect``: signer, whether this host trusts it, and the native-code partitions."""
    native = [p for p in art.manifest.get("partitions") or () if _native_engine(p.get("engine"))]
    out = {"signer": None, "public_key": None, "trusted": None, "valid": True, "error": None,
           "native": [f"partition {p.get('id')} ({p.get('engine')})" for p in native]}
    try:
        v = admit(art, source, False)
        if v.signer is not None:
            out["signer"], out["public_key"] = fingerprint(v.signer), encode_key(v.signer)
        out["trusted"] = trusted_by(art, source)
    except SignatureError as e:
        out["valid"], out["error"] = False, str(e)
    return out


def _native_engine(name) -> bool:
    from kiln import engines
    return engines.native_code(str(name))
