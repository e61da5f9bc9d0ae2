"""Fuzzing the artifact loader with mutated real artifacts (issue 14).

Real ``.kiln`` files (an MLP on ONNX Runtime, one with a host fallback op, a
bucketed and a dynamic-batch model with nested artifacts, an OpenVINO one) are
taken apart into a tree (manifest + blobs, nested artifacts as subtrees),
mutated at any level and written back:

* zip structure: end-of-central-directory and central directory fields, local
  header fields, the alignment extra field, member offsets and sizes, duplicated
  members, bytes flipped or inserted anywhere, truncation;
* the manifest: keys deleted, values replaced by other types, huge or negative
  numbers, wrong shapes and dtypes, unknown engines, program steps pointing at
  values that do not exist ...;
* blob bytes, both with the digests left stale (the load-time check must catch
  them) and with the digests recomputed (what an engine sees if the writer was
  broken, not the disk).

Levels above a mutated nested artifact are re-sealed, so the mutation reaches
the code that reads the nested artifact instead of stopping at the outer
digest check.

The oracle: every case either loads (and then a call on valid inputs works or
raises a ``KilnError``) or raises a ``KilnError`` subclass. Any other exception,
a crash or a hang fails. Cases run in process under hypothesis (which shrinks a
failure to a small mutation), and a seeded batch also runs in a subprocess, so
a segfault in native code shows as a signal exit instead of killing pytest.
"""
from __future__ import annotations

import copy
import io
import json
import random
import signal
import struct
import subprocess
import sys
import time
import warnings
import zipfile

import pytest
import torch

import kiln
from kiln.artifact.container import Artifact, ALIGN, MANIFEST, SIGNATURE
from kiln.artifact.specs import Output
from tests import forkserver, models
from tests.conftest import ROOT
from tests.reliability import count, long_run, record

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(900 if long_run() else 300)]

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

CASE_SECONDS = 20          # a case that takes longer is a hang
FIGURES = {"cases": 0, "good_loads": 0, "kiln_errors": 0, "other_exceptions": 0,
           "crashes": 0, "hangs": 0, "seconds": 0.0}


# -- the artifacts ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus():
    """name -> (artifact bytes, valid inputs: a tensor, a tuple of positional or a dict of
    keyword inputs)."""
    out = {}
    torch.manual_seed(0)
    mlp, x = models.mlp()
    out["mlp"] = (kiln.trace(mlp, x).to_bytes(), x)
    custom, xc = models.custom_op()
    out["fallback"] = (kiln.trace(custom, xc).to_bytes(), xc)
    out["bucketed"] = (kiln.trace(mlp, x, buckets={"x": {0: [1, 3]}}).to_bytes(), torch.randn(2, 16))
    out["dynamic_batch"] = (kiln.dynamic_batch(kiln.load(out["mlp"][0])).to_bytes(), torch.randn(5, 16))
    out["pipeline"] = (kiln.trace(mlp, x, pipeline_cores=2).to_bytes(), x)
    tree = models.Pytree().eval()
    pair, extras = (torch.randn(2, 4), torch.randn(2, 4)), {"w": torch.randn(4)}
    out["pytree"] = (kiln.trace(tree, (pair, extras)).to_bytes(), (pair, extras))
    try:
        out["openvino"] = (kiln.trace(mlp, x, engine="openvino").to_bytes(), x)
    except kiln.KilnError:      # OpenVINO not installed: the others still cover the loader
        pass
    for name, (data, inputs) in out.items():
        assert attempt(data, inputs) == "good", name    # every seed is a good artifact
    return out


# -- an artifact as a tree ----------------------------------------------------------------------------

class Node:
    """A parsed artifact: its manifest, its blobs (bytes, or a Node for nested artifacts)
    and the mutations to apply when it is written back."""

    def __init__(self, data: bytes, keep_signature=False):
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            self.manifest = json.loads(z.read(MANIFEST))
            listed = self.manifest.get("blobs", {})
            self.order = [n for n in z.namelist() if n in listed]
            self.blobs = {}
            for name in self.order:
                blob = z.read(name)
                self.blobs[name] = Node(blob) if name.endswith(".kiln") else blob
            # members the blob table does not list: written back as they were, except the
            # signature, which any change to the manifest would break (then every mutation
            # stopped at the signature check); unsigned artifacts load as well
            self.extras = {n: z.read(n) for n in z.namelist()
                           if n != MANIFEST and n not in listed and (keep_signature or n != SIGNATURE)}
        self.manifest_edits = []     # f(manifest), after sealing
        self.blob_edits = []         # (name, f(bytes), reseal)
        self.raw_edits = []          # f(file bytes) after writing
        self.duplicate = None        # (member name, replacement bytes or None)

    def nodes(self, path=()):
        yield path, self
        for name, b in self.blobs.items():
            if isinstance(b, Node):
                yield from b.nodes(path + (name,))

    def to_bytes(self, raw_edits=True) -> bytes:
        """The artifact with every mutation (those of the zip bytes only if ``raw_edits``)."""
        blobs = {n: (b.to_bytes() if isinstance(b, Node) else b) for n, b in self.blobs.items()}
        for name, edit, reseal in self.blob_edits:
            if reseal:
                blobs[name] = edit(blobs[name])
        manifest = copy.deepcopy(self.manifest)
        Artifact(manifest, blobs).seal()
        for name, edit, reseal in self.blob_edits:
            if not reseal:
                blobs[name] = edit(blobs[name])
        for edit in self.manifest_edits:
            try:
                edit(manifest)
            except (KeyError, IndexError, TypeError):
                pass        # an earlier edit removed what this one aimed at
        data = write_zip(manifest, blobs, self.order, self.duplicate, self.extras)
        for edit in self.raw_edits if raw_edits else ():
            data = edit(data)
        return data


def write_zip(manifest, blobs, order, duplicate=None, extras=None) -> bytes:
    """What ``Artifact._write`` writes (stored, blobs page-aligned), without re-sealing."""
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # "Duplicate name"
        with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as z:
            try:
                text = json.dumps(manifest, indent=1, sort_keys=True)
            except TypeError:   # mixed key types after a mutation
                text = json.dumps(manifest, indent=1)
            z.writestr(zipfile.ZipInfo(MANIFEST), text)
            for name, data in (extras or {}).items():
                z.writestr(zipfile.ZipInfo(name), data)
            members = [(n, blobs[n]) for n in order if n in blobs]
            members += [(n, b) for n, b in blobs.items() if n not in order]
            if duplicate is not None:
                name, data = duplicate
                members.append((name, data if data is not None else
                                (text.encode() if name == MANIFEST else blobs.get(name, b""))))
            for name, data in members:
                info = zipfile.ZipInfo(name)
                start = z.fp.tell() + 30 + len(name.encode()) + 4
                pad = (-start) % ALIGN
                info.extra = struct.pack("<HH", 0xD935, pad) + bytes(pad)
                z.writestr(info, data)
    return buf.getvalue()


# -- zip layout ------------------------------------------------------------------------------------

# (name, offset, struct format) of the fields of each zip record
EOCD_FIELDS = [("signature", 0, "<I"), ("disk", 4, "<H"), ("cd_disk", 6, "<H"),
               ("entries_here", 8, "<H"), ("entries", 10, "<H"), ("cd_size", 12, "<I"),
               ("cd_offset", 16, "<I"), ("comment_len", 20, "<H")]
CD_FIELDS = [("signature", 0, "<I"), ("made_by", 4, "<H"), ("needed", 6, "<H"), ("flags", 8, "<H"),
             ("method", 10, "<H"), ("time", 12, "<H"), ("date", 14, "<H"), ("crc", 16, "<I"),
             ("csize", 20, "<I"), ("usize", 24, "<I"), ("name_len", 28, "<H"),
             ("extra_len", 30, "<H"), ("comment_len", 32, "<H"), ("disk", 34, "<H"),
             ("iattr", 36, "<H"), ("eattr", 38, "<I"), ("local_offset", 42, "<I")]
LOCAL_FIELDS = [("signature", 0, "<I"), ("needed", 4, "<H"), ("flags", 6, "<H"), ("method", 8, "<H"),
                ("time", 10, "<H"), ("date", 12, "<H"), ("crc", 14, "<I"), ("csize", 18, "<I"),
                ("usize", 22, "<I"), ("name_len", 26, "<H"), ("extra_len", 28, "<H")]


def layout(data: bytes):
    """Records of a zip written by kiln: {"eocd": off, "cd": [off...], "local": [(off, name_len,
    extra_len, data_off, size)...]}, and the region boundaries for truncation."""
    eocd = data.rfind(b"PK\x05\x06")
    entries, cd_size, cd_offset = struct.unpack_from("<HII", data, eocd + 10)
    cd, local, pos = [], [], cd_offset
    for _ in range(entries):
        cd.append(pos)
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, pos + 28)
        (lo,) = struct.unpack_from("<I", data, pos + 42)
        (size,) = struct.unpack_from("<I", data, pos + 24)
        ln, le = struct.unpack_from("<HH", data, lo + 26)
        local.append((lo, ln, le, lo + 30 + ln + le, size))
        pos += 46 + name_len + extra_len + comment_len
    bounds = {0, len(data), eocd, cd_offset, cd_offset + cd_size}
    for p in cd:
        bounds |= {p, p + 46}
    for lo, ln, le, start, size in local:
        bounds |= {lo, lo + 30, lo + 30 + ln, start, start + size}
    return {"eocd": eocd, "cd": cd, "local": local, "bounds": sorted(bounds)}


def set_field(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    width = struct.calcsize(fmt)
    value %= 1 << (8 * width)
    return data[:offset] + struct.pack(fmt, value) + data[offset + width:]


def field_values(old: int, fmt: str, n: int):
    top = (1 << (8 * struct.calcsize(fmt))) - 1
    return [0, 1, old - 1, old + 1, old + ALIGN, old - ALIGN, top, top - 1, old ^ 0x80, n, n - 1,
            old * 2, 0x8000, 0x7FFF]


# -- mutations -----------------------------------------------------------------------------------

class Chooser:
    """Where mutations take their decisions: hypothesis data (shrinks) or a seeded Random."""

    def __init__(self, data=None, rng=None):
        self.data, self.rng = data, rng

    def int(self, lo, hi):
        if self.data is not None:
            return self.data.draw(st.integers(lo, hi))
        return self.rng.randint(lo, hi)

    def pick(self, seq):
        seq = list(seq)
        return seq[self.int(0, len(seq) - 1)]

    def bytes(self, n):
        if self.data is not None:
            return self.data.draw(st.binary(min_size=1, max_size=n))
        return bytes(self.rng.randrange(256) for _ in range(self.rng.randint(1, n)))


def odd_values(old):
    """Replacements for a JSON value: other types, edge numbers, near-misses."""
    vals = [None, True, False, 0, 1, -1, 2, 7, 2 ** 31, 2 ** 63, 2 ** 64 + 1, 10 ** 30, -(10 ** 20),
            1.5, -0.0, 1e308, float("nan"), float("inf"), "", "x", "float32", "int64", "bool",
            "onnxruntime", "openvino", "inductor", "tensorrt", "cuda", "aten::sort.default",
            "__class__", "partitions/0.onnx", "manifest.json", "../etc/passwd", [], [0], [[]],
            [None], [-1, 16], [2, 16, 1], [2 ** 40, 16], {}, {"t": 0}, {"t": 99}, {"slot": 999},
            {"none": True}, {"dict": []}, {"tuple": [{"t": 5}]}, {"x": 1}]
    if isinstance(old, bool):
        vals += [not old]
    elif isinstance(old, int):
        vals += [old - 1, old + 1, -old, old * 1000, str(old), float(old), [old]]
    elif isinstance(old, float):
        vals += [int(old), str(old), -old]
    elif isinstance(old, str):
        vals += [old + "x", old[:-1], old.upper(), len(old), [old], {old: old}]
    elif isinstance(old, list):
        vals += [old[:-1], old + old[-1:], old[::-1], {"list": old}, str(old), len(old)]
        if old:
            vals += [old[0], old[1:]]
    elif isinstance(old, dict):
        vals += [list(old.items()), list(old), list(old.values()), str(old)]
    return vals


def json_paths(value, path=()):
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from json_paths(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from json_paths(v, path + (i,))


def get_path(value, path):
    for p in path:
        value = value[p]
    return value


def mutate_manifest(ch: Chooser, node: Node):
    """One edit of the manifest: a value replaced, a key or item deleted or added."""
    paths = [p for p in json_paths(node.manifest) if p and p[0] not in ("report", "created",
                                                                       "phases", "validation")]
    # half of the time aim at what the runtime reads
    hot = [p for p in paths if p[0] in ("inputs", "outputs", "program", "partitions", "blobs",
                                        "buckets", "dynamic_batch", "target", "format",
                                        "format_version", "kind", "engine")]
    path = ch.pick(hot if hot and ch.int(0, 1) else paths)
    old = get_path(node.manifest, path)
    op = ch.pick(["replace", "replace", "replace", "delete", "add_key", "dup_item"])
    desc = f"manifest {list(path)} {op}"
    if op == "replace":
        new = ch.pick(odd_values(old))
        desc += f" {old!r:.40} -> {new!r:.40}"

        def edit(m, path=path, new=new):
            get_path(m, path[:-1])[path[-1]] = copy.deepcopy(new)
    elif op == "delete":
        def edit(m, path=path):
            del get_path(m, path[:-1])[path[-1]]
    elif op == "add_key":
        key = ch.pick(["t", "none", "slot", "list", "zzz", "dict", "const", "op"])
        val = ch.pick([0, 5, None, [], "x"])
        desc += f" {key}={val!r}"

        def edit(m, path=path, key=key, val=val):
            target = get_path(m, path)
            if isinstance(target, dict):
                target[key] = val
            elif isinstance(target, list):
                target.append(val)
            else:
                get_path(m, path[:-1])[path[-1]] = {key: val}
    else:
        def edit(m, path=path):
            target = get_path(m, path)
            if isinstance(target, list) and target:
                target.append(copy.deepcopy(target[-1]))
            else:
                get_path(m, path[:-1])[path[-1]] = [target, target]
    node.manifest_edits.append(edit)
    return desc


def mutate_blob(ch: Chooser, node: Node):
    plain = [n for n, b in node.blobs.items() if not isinstance(b, Node)]
    if not plain:
        return mutate_manifest(ch, node)
    name = ch.pick(plain)
    size = len(node.blobs[name])
    reseal = bool(ch.int(0, 1))
    op = ch.pick(["flip", "overwrite", "truncate", "extend", "zero_header"])
    pos = ch.pick([0, 8, 12, 13, 40, 100, size // 2, size - 1, ch.int(0, max(0, size - 1))])
    pos = max(0, min(pos, size - 1))
    if op == "flip":
        bit = ch.int(0, 7)

        def edit(b, pos=pos, bit=bit):
            b = bytearray(b)
            if pos < len(b):    # (an earlier edit may have cut it)
                b[pos] ^= 1 << bit
            return bytes(b)
    elif op == "overwrite":
        junk = ch.bytes(16)

        def edit(b, pos=pos, junk=junk):
            return b[:pos] + junk + b[pos + len(junk):]
    elif op == "truncate":
        def edit(b, pos=pos):
            return b[:pos]
    elif op == "extend":
        junk = ch.bytes(64)

        def edit(b, junk=junk):
            return b + junk
    else:
        def edit(b):
            return bytes(64) + b[64:]
    node.blob_edits.append((name, edit, reseal))
    return f"blob {name} {op} at {pos} ({'resealed' if reseal else 'stale digest'})"


def mutate_zip(ch: Chooser, node: Node, data: bytes):
    """One edit of the written zip's bytes."""
    lay = layout(data)
    n = len(data)
    op = ch.pick(["eocd", "cd", "local", "extra", "truncate", "flip", "insert", "duplicate",
                  "swap_offsets"])
    if op == "duplicate":
        name = ch.pick([MANIFEST] + list(node.blobs))
        what = ch.pick(["same", "junk", "empty"])
        node.duplicate = (name, None if what == "same" else b"" if what == "empty" else ch.bytes(64))
        return f"duplicate member {name} ({what})"
    if op == "truncate":
        cut = ch.pick([ch.pick(lay["bounds"]) + ch.int(-2, 2), ch.int(0, n)])
        cut = max(0, min(cut, n))
        node.raw_edits.append(lambda d, cut=cut: d[:cut])
        return f"truncate at {cut} of {n}"
    if op == "flip":
        pos = ch.pick([ch.pick(lay["bounds"]), ch.int(0, n - 1)])
        pos = max(0, min(pos, n - 1))
        bit = ch.int(0, 7)

        def edit(d, pos=pos, bit=bit):
            d = bytearray(d)
            if pos < len(d):
                d[pos] ^= 1 << bit
            return bytes(d)
        node.raw_edits.append(edit)
        return f"flip bit {bit} at {pos}"
    if op == "insert":
        pos = max(0, min(ch.pick([0, ch.pick(lay["bounds"]), ch.int(0, n)]), n))
        junk = ch.pick([b"PK\x05\x06" + bytes(18), b"PK\x01\x02", ch.bytes(32), bytes(ALIGN)])
        node.raw_edits.append(lambda d, pos=pos, junk=junk: d[:pos] + junk + d[pos:])
        return f"insert {len(junk)} bytes at {pos}"
    if op == "swap_offsets":
        if len(lay["cd"]) < 2:
            op = "cd"
        else:
            a, b = ch.int(0, len(lay["cd"]) - 1), ch.int(0, len(lay["cd"]) - 1)
            pa, pb = lay["cd"][a] + 42, lay["cd"][b] + 42
            va, vb = data[pa:pa + 4], data[pb:pb + 4]

            def edit(d, pa=pa, pb=pb, va=va, vb=vb):
                d = bytearray(d)
                d[pa:pa + 4], d[pb:pb + 4] = vb, va
                return bytes(d)
            node.raw_edits.append(edit)
            return f"swap local header offsets of members {a} and {b}"
    if op == "eocd":
        base, fields = lay["eocd"], EOCD_FIELDS
    elif op == "cd":
        k = ch.int(0, len(lay["cd"]) - 1)
        base, fields = lay["cd"][k], CD_FIELDS
        op = f"cd[{k}]"
    elif op == "local":
        k = ch.int(0, len(lay["local"]) - 1)
        base, fields = lay["local"][k][0], LOCAL_FIELDS
        op = f"local[{k}]"
    else:   # the alignment extra field: its id or its declared size
        cands = [lo for lo, ln, le, _, _ in lay["local"] if le >= 4]
        if not cands:
            return mutate_zip(ch, node, data)
        k = ch.int(0, len(cands) - 1)
        lo = cands[k]
        (ln,) = struct.unpack_from("<H", data, lo + 26)
        base, fields = lo + 30 + ln, [("extra_id", 0, "<H"), ("extra_size", 2, "<H")]
        op = f"extra[{k}]"
    name, off, fmt = ch.pick(fields)
    (old,) = struct.unpack_from(fmt, data, base + off)
    value = ch.pick(field_values(old, fmt, n))
    node.raw_edits.append(lambda d, p=base + off, fmt=fmt, v=value: set_field(d, p, fmt, v))
    return f"{op}.{name}: {old} -> {value % (1 << 8 * struct.calcsize(fmt))}"


def mutate(ch: Chooser, seed: bytes):
    """A mutated copy of ``seed`` (1-3 mutations, any level); returns (bytes, description).
    One case in eight keeps the seed's signature (then most mutations end at its check)."""
    signed = ch.int(0, 7) == 0
    root = Node(seed, keep_signature=signed)
    nodes = list(root.nodes())
    descs = []
    for _ in range(ch.int(1, 3)):
        path, node = ch.pick(nodes)
        kind = ch.pick(["zip", "manifest", "manifest", "manifest", "blob"])
        where = "/".join(path) or "outer"
        if kind == "zip":
            descs.append(f"{where}: {mutate_zip(ch, node, node.to_bytes(raw_edits=False))}")
        elif kind == "manifest":
            descs.append(f"{where}: {mutate_manifest(ch, node)}")
        else:
            descs.append(f"{where}: {mutate_blob(ch, node)}")
    return root.to_bytes(), ("signed: " if signed else "") + "; ".join(descs)


# -- the oracle ------------------------------------------------------------------------------------

class Hang(BaseException):
    pass


def _alarm(signum, frame):
    raise Hang()


def call(m, inputs):
    if isinstance(inputs, dict):
        return m(**inputs)
    return m(*inputs) if isinstance(inputs, tuple) else m(inputs)


def attempt(data: bytes, inputs) -> str:
    """Load ``data`` and call it: "good" or "kiln_error"; anything else propagates."""
    try:
        m = kiln.load(data)
    except kiln.KilnError:
        return "kiln_error"
    try:
        call(m, inputs)
    except kiln.KilnError:
        pass
    finally:
        m.close()
    return "good"


def run_case(data, x, desc):
    # pytest-timeout's own alarm (the same timer) is put back, less the time spent, after
    outer, _ = signal.getitimer(signal.ITIMER_REAL)
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
    started = time.perf_counter()
    try:
        outcome = attempt(data, x)
    except Hang:
        FIGURES["hangs"] += 1
        raise AssertionError(f"hang (> {CASE_SECONDS} s) on: {desc}") from None
    except Exception as e:
        FIGURES["other_exceptions"] += 1
        raise AssertionError(f"{type(e).__name__} (not a KilnError) on: {desc}: {e}") from e
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        spent = time.perf_counter() - started
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - spent, 0.001))
        FIGURES["cases"] += 1
        FIGURES["seconds"] += spent
    FIGURES["good_loads" if outcome == "good" else "kiln_errors"] += 1
    return outcome


def save_figures():
    record("loader_fuzz", **{k: round(v, 2) if isinstance(v, float) else v for k, v in FIGURES.items()})


# -- tests ---------------------------------------------------------------------------------------

SEEDS = ["mlp", "fallback", "bucketed", "dynamic_batch", "pipeline", "pytree", "openvino"]


def test_seeds_load_and_run(corpus):
    for name, (data, x) in corpus.items():
        assert run_case(data, x, name) == "good"
        # an unmutated round trip through the tree gives a loadable artifact too
        assert run_case(Node(data).to_bytes(), x, f"{name} rewritten") == "good"
    save_figures()


def test_mutated_artifacts_load_or_raise_kiln_errors(corpus):
    names = [n for n in SEEDS if n in corpus]

    @settings(max_examples=count(ci=300, long=10000), deadline=None, database=None,
              derandomize=not long_run(), print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def case(data):
        ch = Chooser(data=data)
        name = ch.pick(names)
        seed, x = corpus[name]
        mutated, desc = mutate(ch, seed)
        run_case(mutated, x, f"{name}: {desc}")

    try:
        case()
    finally:
        save_figures()


def test_truncation_everywhere(corpus):
    """Every region boundary (and one byte either side), and every Nth byte, of each seed
    and of each nested artifact inside it (re-sealed above, so the cut reaches it)."""
    step = 97 if long_run() else 1021
    for name, (seed, x) in corpus.items():
        root = Node(seed)
        for path, node in root.nodes():
            plain = node.to_bytes()
            cuts = set(range(0, len(plain), step))
            for b in layout(plain)["bounds"]:
                cuts |= {b - 1, b, b + 1}
            cuts = sorted(c for c in cuts if 0 <= c < len(plain))
            if path:   # nested: only the boundaries (each cut means re-sealing the outer)
                cuts = sorted(c for c in cuts if c % step or c in layout(plain)["bounds"])
            for cut in cuts:
                node.raw_edits = [lambda d, cut=cut: d[:cut]]
                data = root.to_bytes()
                outcome = run_case(data, x, f"{name} {'/'.join(path) or 'outer'} cut at {cut}")
                assert outcome == "kiln_error", f"{name} {path}: a file cut at {cut} loaded"
            node.raw_edits = []
    save_figures()


WORKER = r"""
import json, sys, torch, kiln
from tests import models   # registers the custom op of the fallback model
files = json.load(open(sys.argv[1]))
for path, inputs in files:
    print("start", path, flush=True)
    x = torch.load(inputs, weights_only=True)
    try:
        m = kiln.load(path)
    except kiln.KilnError:
        print("result kiln_error", flush=True)
        continue
    except Exception as e:
        print("result other", type(e).__name__, str(e)[:200].replace("\n", " "), flush=True)
        continue
    try:
        if isinstance(x, dict):
            m(**x)
        else:
            m(*x) if isinstance(x, tuple) else m(x)
    except kiln.KilnError:
        pass
    except Exception as e:
        print("result other", type(e).__name__, str(e)[:200].replace("\n", " "), flush=True)
        continue
    m.close()
    print("result good", flush=True)
print("done", flush=True)
"""


def test_mutated_artifacts_in_a_subprocess(corpus, tmp_path):
    """A seeded batch loaded and called in a fresh interpreter: a crash in native code
    (ONNX Runtime, OpenVINO, zipfile, mmap) shows as a signal exit naming the file."""
    rng = random.Random(14)
    names = sorted(corpus)
    for name in names:
        torch.save(corpus[name][1], tmp_path / f"{name}.inputs.pt")
    files, descs = [], {}
    for i in range(count(ci=60, long=2000)):
        name = names[i % len(names)]
        seed, x = corpus[name]
        data, desc = mutate(Chooser(rng=rng), seed)
        path = tmp_path / f"case{i}.kiln"
        path.write_bytes(data)
        files.append((str(path), str(tmp_path / f"{name}.inputs.pt")))
        descs[str(path)] = f"{name}: {desc}"
    listing = tmp_path / "files.json"
    listing.write_text(json.dumps(files))
    started = time.perf_counter()
    try:
        r = forkserver.run([sys.executable, "-c", WORKER, str(listing)], cwd=ROOT, text=True,
                           capture_output=True, timeout=CASE_SECONDS * len(files))
    except subprocess.TimeoutExpired as e:
        FIGURES["hangs"] += 1
        save_figures()
        out = e.stdout or ""
        out = out if isinstance(out, str) else out.decode()
        last = [line for line in out.splitlines() if line.startswith("start")][-1:]
        raise AssertionError(f"subprocess hung at {last}: {descs.get(last[0][6:]) if last else ''}")
    lines = r.stdout.splitlines()
    results = [line.split(" ", 2) for line in lines if line.startswith("result")]
    FIGURES["cases"] += len(results)
    FIGURES["seconds"] += time.perf_counter() - started
    FIGURES["good_loads"] += sum(1 for r_ in results if r_[1] == "good")
    FIGURES["kiln_errors"] += sum(1 for r_ in results if r_[1] == "kiln_error")
    others = [(lines[i - 1], line) for i, line in enumerate(lines) if line.startswith("result other")]
    FIGURES["other_exceptions"] += len(others)
    if r.returncode != 0:
        FIGURES["crashes"] += 1
    save_figures()
    started_files = [line[6:] for line in lines if line.startswith("start")]
    assert r.returncode == 0, (f"subprocess died with {r.returncode} at {started_files[-1:]}: "
                               f"{descs.get(started_files[-1]) if started_files else ''}\n"
                               f"{r.stderr[-3000:]}")
    assert not others, "\n".join(f"{descs[s[6:]]}: {o}" for s, o in others)
    assert "done" in lines and len(results) == len(files)


# -- what the fuzzing found, kept as plain regressions ------------------------------------------------

def test_a_manifest_cannot_make_decoding_build_an_arbitrary_class(corpus, tmp_path):
    """Outputs decoded into the class a ``model_output`` node names: only a Hugging Face
    ModelOutput may be built; ``subprocess:Popen`` with const fields ran a shell command."""
    import subprocess  # noqa: F401  (imported, as in any real process)
    seed, x = corpus["mlp"]
    root = Node(seed)
    marker = tmp_path / "ran"
    root.manifest["outputs"]["structure"] = {
        "model_output": [["args", {"const": f"touch {marker}"}], ["shell", {"const": True}],
                         ["y", {"t": 0}]],
        "class": "subprocess:Popen"}
    out = kiln.load(root.to_bytes())(x)
    time.sleep(0.2)
    assert not marker.exists()
    assert isinstance(out, Output) and out["y"].shape == (2, 4)


def test_a_host_op_name_must_name_an_operator(corpus):
    seed, x = corpus["fallback"]
    for name in ("__class__::__init__.__call__", "bool", "aten::add"):
        root = Node(seed)
        step = next(s for s in root.manifest["program"]["steps"] if "op" in s)
        step["op"] = name
        with pytest.raises(kiln.ArtifactError, match="not a torch operator|not an operator name"):
            kiln.load(root.to_bytes())


def test_a_cut_that_leaves_a_nested_artifact_at_the_end_is_refused(corpus):
    """zipfile takes the last end-of-directory record it finds: cut at the end of a nested
    artifact, a bucketed or dynamic-batch file read as that inner model."""
    for name in ("bucketed", "dynamic_batch"):
        seed, _ = corpus[name]
        lo, ln, le, start, size = layout(seed)["local"][-1]
        with pytest.raises(kiln.ArtifactError, match="no zip directory at its end"):
            kiln.load(seed[:start + size])


def test_a_model_may_return_its_input_unchanged():
    """The single-partition fast path looked every output up among the partition's."""
    class PassThrough(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return x, self.lin(x)

    model, x = PassThrough().eval(), torch.randn(2, 4)
    loaded = kiln.load(kiln.trace(model, x).to_bytes())
    same, y = loaded(x)
    assert torch.equal(same, x)
    torch.testing.assert_close(y, model(x)[1].detach(), atol=1e-5, rtol=1e-5)


def test_members_zipfile_cannot_read_are_artifact_errors(corpus):
    """A compression method zipfile lacks, the encryption flag or a newer zip version on
    any member (the signature included) raised NotImplementedError or RuntimeError."""
    seed, x = corpus["mlp"]
    data = Node(seed, keep_signature=True).to_bytes()
    lay = layout(data)
    fields = {name: (off, fmt) for name, off, fmt in CD_FIELDS}
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        names = z.namelist()
    assert SIGNATURE in names
    for entry, member in zip(lay["cd"], names):
        for name, value in (("method", 99), ("flags", 1), ("needed", 0xFFFF)):
            off, fmt = fields[name]
            outcome = attempt(set_field(data, entry + off, fmt, value), x)
            # a blob is read where it lies and checked by its digest, flags or not
            if member in (MANIFEST, SIGNATURE) or name != "flags":
                assert outcome == "kiln_error", (member, name)
