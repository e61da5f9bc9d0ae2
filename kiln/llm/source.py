"""Reading a decoder and its tokenizer from where Hugging Face keeps them: a checkpoint
directory (safetensors and config) or a GGUF file, which transformers dequantizes to
float32 weights (it needs the ``gguf`` package). Only local files: nothing is downloaded.
A GGUF file's header is checked first (:mod:`kiln.llm.gguf_file`), so a corrupt file or
a tensor type kiln does not read fails with a message naming it; the file a model came
from is remembered (:func:`gguf_path`) for ``quantize="gguf"`` (:mod:`kiln.llm.gguf_keep`).

transformers reads a GGUF file's header once for the config, once for the tokenizer and
once for the weights, parsing every field (SmolLM2's 49,152-token vocabulary and its
merges) each time, and builds the same tensor-name table once per module of the model:
for SmolLM2-135M, 24 s of a 26 s load. :func:`_gguf_parsed_once` shares one parse per file
and one table per architecture for the length of the load.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
import weakref

from kiln.errors import CompilerArgsError, UnsupportedModelError
from kiln.llm import gguf_file


def load_pretrained(source: str):
    """``(model, tokenizer or None)`` from a checkpoint directory or a ``.gguf`` file."""
    source = os.fspath(source)
    if not os.path.exists(source):
        raise CompilerArgsError(f"{source}: no such file or directory (give a Hugging Face checkpoint "
                                "directory or a .gguf file; nothing is downloaded)")
    if os.path.isfile(source):
        if not source.lower().endswith(".gguf"):
            raise CompilerArgsError(f"{source}: a file must be a .gguf; otherwise give the checkpoint directory")
        gguf_file.check(source)         # a corrupt file or a type kiln does not read: a clear error first
        folder, where = os.path.dirname(os.path.abspath(source)), {"gguf_file": os.path.basename(source)}
    else:
        folder, where = source, {}
    with _gguf_parsed_once() if where else contextlib.nullcontext():
        model, tokenizer = _load(folder, where, source)
    if where:
        _GGUF_SOURCES[model] = (os.path.abspath(source), _stamp(source))
    return model, tokenizer


# model -> the GGUF file it was loaded from (quantize="gguf" reads the file's blocks again)
_GGUF_SOURCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def gguf_path(model):
    """The GGUF file :func:`load_pretrained` loaded ``model`` from, or None; a
    :class:`CompilerArgsError` when that file is gone or changed since (its blocks would not
    be the model's weights: a file replaced by another kept none of them, without a word)."""
    found = _GGUF_SOURCES.get(model)
    if found is None:
        return None
    path, stamp = found
    if not os.path.isfile(path) or _stamp(path) != stamp:
        raise CompilerArgsError(f"{path}, the GGUF file this model was loaded from, is "
                                f"{'gone' if not os.path.isfile(path) else 'changed'} since: quantize='gguf' "
                                "reads its blocks again; load the model from the file again")
    return path


def _stamp(path) -> tuple:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def _mismatched(folder, where) -> str | None:
    """Which tensors have another shape than the model's, by loading once more without
    refusing them: transformers' own error names none ("You set ignore_mismatched_sizes to
    False ... look at the above report!"), and a user cannot pass its option through kiln."""
    import torch
    import transformers
    try:
        _, info = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, local_files_only=True, output_loading_info=True,
            ignore_mismatched_sizes=True, **where)
    except Exception:  # noqa: BLE001 - only a better message was sought; the first error stands
        return None
    wrong = [f"{key} is {tuple(found)} in the file, {tuple(wanted)} in the model"
             for key, found, wanted in (info or {}).get("mismatched_keys") or ()]
    if not wrong:
        return None
    return (f"{len(wrong)} tensor(s) have another shape than the model its config describes needs: "
            f"{'; '.join(wrong[:4])}{'; ...' if len(wrong) > 4 else ''} (the file's metadata, such as its "
            "head counts or lengths, and its tensors disagree)")


def _load(folder, where, source):
    import torch
    import transformers
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, local_files_only=True, output_loading_info=True, **where)
    except (ValueError, KeyError, RuntimeError) as e:   # RuntimeError: a tensor of the wrong shape
        raise UnsupportedModelError(f"{source}: transformers cannot load a causal LM from it: "
                                    f"{_mismatched(folder, where) or e}") from None
    except ImportError as e:
        raise CompilerArgsError(f"{source}: {e} (GGUF files need the 'gguf' package)") from None
    missing = sorted((info or {}).get("missing_keys") or ())
    if missing:
        # transformers fills them with a fresh random initialisation and only prints a report:
        # a model compiled from that answers wrongly, and its accuracy gate, whose reference
        # is the same model, cannot see it
        raise UnsupportedModelError(
            f"{source}: {len(missing)} weight(s) the model needs are not in it ({', '.join(missing[:5])}"
            f"{', ...' if len(missing) > 5 else ''}); transformers would start them from random values. "
            "The checkpoint is incomplete or for another architecture")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True, **where)
    except (OSError, ValueError):
        tokenizer = None              # the graphs still compile; text in and out needs one
    return model.eval(), tokenizer


_GGUF_LOCK = threading.Lock()


@contextlib.contextmanager
def _gguf_parsed_once():
    """For the length of a load, ``gguf.GGUFReader(path)`` returns one reader per file and
    ``gguf.get_tensor_name_map`` one table per (architecture, layers): transformers imports
    both from ``gguf`` at each call, so standing in for them on the module covers its three
    reads. Readers only read (a read-only memory map), so sharing one changes nothing it
    computes. Two more stand-ins (12-02), each measured on SmolLM2's file: the reader reads
    its header through a plain array over the same mapping (:func:`_plain_map`: 3.2 -> 2.0 s),
    and transformers' value parser answers a field's part it parsed before from memory, since
    it parses the whole vocabulary on each of its three reads (:func:`_parse_once`). The
    stand-ins are process-wide, hence the lock; the originals come back after."""
    try:
        import gguf
    except ImportError:             # transformers' own error says what to install
        yield
        return
    with _GGUF_LOCK:
        original_reader, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers = {}

        def reader(path, mode="r"):
            key = (os.path.abspath(os.fspath(path)), mode)
            if key not in readers:
                with _plain_map(mode):
                    readers[key] = original_reader(path, mode)
            return readers[key]
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(original_map)
        try:
            with _parse_once():
                yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_map


@contextlib.contextmanager
def _plain_map(mode: str):
    """``gguf``'s reader maps the file with ``np.memmap`` and then slices it twice for every
    string of the vocabulary (3.7 million slices for SmolLM2), each paying ``memmap``'s
    Python-level ``__getitem__`` and ``__array_finalize__`` (4.6 of the reader's 5.3 s under
    cProfile). A plain ``ndarray`` view of the same read-only mapping slices in C; the fields
    and tensors read are the same bytes (checked on SmolLM2's file). Only read-only maps."""
    import types

    import numpy as np
    from gguf import gguf_reader
    if mode != "r" or getattr(gguf_reader, "np", None) is not np:
        yield
        return

    class _Numpy(types.ModuleType):
        def __getattr__(self, name):
            return getattr(np, name)
    shim = _Numpy("numpy")
    shim.memmap = lambda path, mode="r": np.memmap(path, mode=mode).view(np.ndarray)
    gguf_reader.np = shim
    try:
        yield
    finally:
        gguf_reader.np = np


@contextlib.contextmanager
def _parse_once():
    """transformers' ``_gguf_parse_value`` for the parts of the shared reader's fields,
    remembered by the part (a reader's parts live as long as the load): the config's, the
    tokenizer's and the weights' reads each parsed all 49,152 tokens and the merges again.
    A list value is handed out as a copy, so a caller that changes it changes only its own."""
    try:
        from transformers import modeling_gguf_pytorch_utils as utils
    except ImportError:
        yield
        return
    original = getattr(utils, "_gguf_parse_value", None)
    if original is None:
        yield
        return
    parsed = {}

    def parse(value, data_type):
        key = (id(value), tuple(data_type) if isinstance(data_type, list) else data_type)
        if key not in parsed:
            parsed[key] = (value, original(value, data_type))       # the part kept: its id stays its own
        result = parsed[key][1]
        return list(result) if isinstance(result, list) else result
    utils._gguf_parse_value = parse
    try:
        yield
    finally:
        utils._gguf_parse_value = original
