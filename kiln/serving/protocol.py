"""The Open Inference Protocol (KServe v2, as Triton speaks it): requests to tensors and back.

Pure functions on bytes, JSON objects and tensors, with no HTTP and no model
running, so the codec can be tested alone and a second protocol can sit beside
it (a new module next to this one, with its routes in :mod:`kiln.serving.app`).
A request is checked against the model's :class:`Signature` (names, datatypes,
shapes, with -1 where a dim varies) and every mistake is a
:class:`~kiln.errors.BadRequestError` whose message names the input and says
what was expected.

Tensors travel as JSON ``data`` (row-major, flattened or nested) or as binary
tensor data after the JSON header (``Inference-Header-Content-Length``; the
``binary_tensor_data`` extension).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch

from kiln.errors import BadRequestError

# KServe v2 datatypes <-> torch dtypes (BYTES, i.e. strings, has no tensor counterpart)
DATATYPES = {
    "BOOL": torch.bool, "UINT8": torch.uint8, "INT8": torch.int8, "INT16": torch.int16,
    "INT32": torch.int32, "INT64": torch.int64, "FP16": torch.float16, "FP32": torch.float32,
    "FP64": torch.float64, "BF16": torch.bfloat16,
}
for _name in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        DATATYPES[_name.upper()] = getattr(torch, _name)
DATATYPE_OF = {v: k for k, v in DATATYPES.items()}
MAX_ERROR_CHARS = 2000      # longer error messages (quoting a client's bytes) are cut


def datatype_of(dtype: torch.dtype) -> str:
    """The protocol's name of ``dtype`` (torch's own name where the protocol has none)."""
    return DATATYPE_OF.get(dtype, str(dtype))


def error_body(message: str) -> bytes:
    """The protocol's error body. ASCII JSON: a message quoting the client's bytes (a lone
    surrogate in a name) must not fail to encode; long quotes are cut."""
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS] + f"... ({len(message)} characters)"
    return json.dumps({"error": message}).encode()


# -- the model as the protocol sees it ----------------------------------------------------------
@dataclass
class Signature:
    """A served model's tensors as the protocol publishes them: its URL name, the specs, and
    metadata entries (name, datatype, shape with -1 where the dim varies)."""
    name: str
    input_specs: list
    output_specs: list
    inputs: list                 # [{"name", "datatype", "shape"}] per input
    outputs: list                # [{"name", "datatype", "shape"}] per output
    input_index: dict = field(init=False)
    output_index: dict = field(init=False)

    def __post_init__(self):
        self.input_index = {s.name: i for i, s in enumerate(self.input_specs)}
        self.output_index = {s.name: o for o, s in enumerate(self.output_specs)}


def signature_of(name: str, input_specs, output_specs, input_var, output_var) -> Signature:
    """The :class:`Signature` of a model; ``input_var``/``output_var`` hold each tensor's set of
    varying dims (published as -1)."""
    def entries(specs, var):
        return [{"name": s.name, "datatype": datatype_of(s.dtype),
                 "shape": [-1 if d in var[k] else int(n) for d, n in enumerate(s.shape)]}
                for k, s in enumerate(specs)]
    input_specs, output_specs = list(input_specs), list(output_specs)
    return Signature(name, input_specs, output_specs, entries(input_specs, input_var),
                     entries(output_specs, output_var))


# -- tensors on the wire -----------------------------------------------------------------------------
def tensor_from_json(data, dtype: torch.dtype, shape: list, name: str) -> torch.Tensor:
    """A tensor from an input's JSON ``data`` (flat, or nested as ``shape``), checked against
    ``dtype`` with no implicit casts (true/false only for BOOL, integers only for integer
    types, numbers but no true/false for floats) and ``shape``."""
    count = math.prod(shape)
    try:
        flat = flatten_json(data, shape)
        if dtype == torch.bool:
            if not all(isinstance(v, bool) for v in flat):
                raise ValueError("BOOL data must be true/false")
            t = torch.tensor(flat, dtype=torch.bool)
        elif dtype.is_floating_point:
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in flat):
                raise ValueError(f"{DATATYPE_OF[dtype]} data must be numbers (true/false is BOOL data)")
            wide = torch.tensor(flat, dtype=torch.float64)
            t = wide.to(dtype)
            overflow = torch.isinf(t) & torch.isfinite(wide)
            if bool(overflow.any()):
                value = wide[overflow][0].item()
                raise ValueError(f"{value:g} does not fit {DATATYPE_OF[dtype]} (largest finite value "
                                 f"{torch.finfo(dtype).max:g}); it would become infinity")
        else:
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
                raise ValueError(f"{DATATYPE_OF[dtype]} data must be integers")
            t = torch.tensor(flat, dtype=dtype)
    except (ValueError, TypeError, OverflowError, RuntimeError) as e:
        raise BadRequestError(f"input '{name}': cannot read 'data' as {DATATYPE_OF[dtype]}: {e}") from None
    if t.numel() != count:
        raise BadRequestError(f"input '{name}': shape {shape} needs {count} values, 'data' has {t.numel()}")
    return t.reshape(shape)


def flatten_json(data, shape: list) -> list:
    """Row-major values of an input's JSON ``data``: a flat list, or lists nested as the shape
    (``[2, 3]``: 2 lists of 3 values; the innermost lists may also hold the rest of the shape
    flattened: ``[2, 3, 4]`` as 2 lists of 12). Nesting that is ragged or does not follow
    ``shape`` is refused, never re-split. Level by level, without recursion limits."""
    if not isinstance(data, list):
        raise ValueError("'data' must be a list")
    if not data or not isinstance(data[0], list):
        return data              # flat (a list inside it fails the datatype check)
    level, dims = [data], []
    while level and isinstance(level[0], list):
        n = len(level[0])
        for k, item in enumerate(level):
            if not isinstance(item, list) or len(item) != n:
                what = f"{len(item)} values" if isinstance(item, list) else "a value, not a list"
                raise ValueError(f"nested 'data' is ragged: at depth {len(dims)}, list {k} has {what}, "
                                 f"list 0 has {n}; send it flat or nested as the shape {shape}")
        dims.append(n)
        level = [v for item in level for v in item]
    if any(isinstance(v, list) for v in level):
        raise ValueError(f"nested 'data' is ragged: lists and values at the same depth; send it flat "
                         f"or nested as the shape {shape}")
    k = len(dims)                # dims: the list lengths at each depth ([count] when flat)
    if k > 1 and (k > len(shape) or dims[:-1] != list(shape[:k - 1]) or dims[-1] != math.prod(shape[k - 1:])):
        raise ValueError(f"nested 'data' has dims {dims}, which do not follow the shape {shape}; "
                         "send it flat or nested as the shape")
    return level


def tensor_from_bytes(chunk, dtype: torch.dtype, shape: list, name: str) -> torch.Tensor:
    """A tensor from an input's binary data (little-endian, row-major), checked for size."""
    count = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(chunk) != count * itemsize:
        raise BadRequestError(f"input '{name}': shape {shape} of {DATATYPE_OF[dtype]} needs "
                              f"{count * itemsize} bytes, binary_data_size is {len(chunk)}")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    if dtype == torch.bool:     # any non-zero byte is true (never an invalid bool in a tensor)
        return torch.frombuffer(bytearray(chunk), dtype=torch.uint8).ne(0).reshape(shape)
    return torch.frombuffer(bytearray(chunk), dtype=dtype).reshape(shape)


def tensor_to_bytes(t: torch.Tensor) -> bytes:
    """An output's binary data (row-major; BF16 as its raw 16 bits)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def parse_body(body: bytes, header_length) -> tuple:
    """(JSON request, the binary data after it) of an infer request body; ``header_length`` is
    the ``Inference-Header-Content-Length`` header (None: the whole body is JSON)."""
    if header_length is None:
        json_part, rest = body, b""
    else:
        try:
            n = int(header_length)
        except ValueError:
            raise BadRequestError(f"Inference-Header-Content-Length must be an integer, "
                                  f"got {header_length!r}") from None
        if not 0 <= n <= len(body):
            raise BadRequestError(f"Inference-Header-Content-Length {n} is outside the body of "
                                  f"{len(body)} bytes")
        view = memoryview(body)
        json_part, rest = view[:n], view[n:]
    try:
        payload = json.loads(bytes(json_part))
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequestError(f"malformed JSON in the request: {e}") from None
    except RecursionError:
        raise BadRequestError("malformed JSON in the request: nested too deeply") from None
    if not isinstance(payload, dict):
        raise BadRequestError("the inference request must be a JSON object")
    return payload, rest


# -- inference requests ------------------------------------------------------------------------------
@dataclass
class InferRequest:
    """A decoded inference request."""
    inputs: list                 # flat input tensors, in the model's order
    outputs: list                # [(output index, as binary data)] to return, in order
    id: str | None               # echoed in the response
    timeout: float | None        # seconds the client allows (None: the server's timeout)


def decode_request(sig: Signature, payload: dict, binary, check=None) -> InferRequest:
    """Check an infer request (JSON object and binary data) against ``sig``; raises
    :class:`~kiln.errors.BadRequestError` with what is wrong. ``check(flat)``, when given,
    checks the decoded inputs further (the model's own input check) before the rest."""
    params = payload.get("parameters") or {}
    if not isinstance(params, dict):
        raise BadRequestError("'parameters' must be a JSON object")
    flat = decode_inputs(sig, payload.get("inputs"), binary)
    if check is not None:
        check(flat)
    binary_default = params.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise BadRequestError("parameter binary_data_output must be true or false")
    wanted = decode_outputs(sig, payload.get("outputs"), binary_default)
    timeout = None
    if params.get("timeout") is not None:        # microseconds, as Triton
        t = params["timeout"]
        if not isinstance(t, (int, float)) or isinstance(t, bool) or t <= 0:
            raise BadRequestError("parameter timeout must be a positive number of microseconds")
        timeout = t / 1e6
    req_id = payload.get("id")
    if req_id is not None and not isinstance(req_id, str):
        raise BadRequestError("'id' must be a string")
    return InferRequest(flat, wanted, req_id, timeout)


def decode_inputs(sig: Signature, entries, binary) -> list:
    """The request's ``inputs`` as flat tensors in the model's order; every input given once,
    and the binary data used up exactly."""
    if not isinstance(entries, list) or not entries:
        raise BadRequestError("the request needs a non-empty 'inputs' list")
    tensors: dict = {}
    offset = 0
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise BadRequestError("every input must be an object with a 'name'")
        name = entry["name"]
        if name in tensors:
            raise BadRequestError(f"input '{name}' is given twice")
        i = sig.input_index.get(name)
        if i is None:
            raise BadRequestError(f"unknown input '{name}'; model '{sig.name}' takes "
                                  f"{', '.join(repr(s.name) for s in sig.input_specs)}")
        tensors[name], offset = decode_input(entry, sig.input_specs[i], sig.inputs[i], binary, offset)
    if offset != len(binary):
        raise BadRequestError(f"{len(binary) - offset} bytes of binary data follow the last binary input")
    missing = [s.name for s in sig.input_specs if s.name not in tensors]
    if missing:
        raise BadRequestError(f"missing input(s) {', '.join(repr(m) for m in missing)} "
                              f"for model '{sig.name}'")
    return [tensors[s.name] for s in sig.input_specs]


def decode_input(entry: dict, spec, want: dict, binary, offset: int) -> tuple:
    """(tensor, offset after its binary data) of one input entry, checked against its spec and
    published metadata ``want``."""
    name = entry["name"]
    datatype, shape = entry.get("datatype"), entry.get("shape")
    if datatype != want["datatype"]:
        raise BadRequestError(f"input '{name}': expected datatype {want['datatype']}, got {datatype!r}")
    if (not isinstance(shape, list)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise BadRequestError(f"input '{name}': 'shape' must be a list of non-negative integers, "
                              f"got {shape!r}")
    if len(shape) != len(want["shape"]) or any(
            w != -1 and s != w for s, w in zip(shape, want["shape"])):
        raise BadRequestError(f"input '{name}': expected shape {want['shape']} (-1: any size), got {shape}")
    eparams = entry.get("parameters") or {}
    if not isinstance(eparams, dict):
        raise BadRequestError(f"input '{name}': 'parameters' must be a JSON object")
    size = eparams.get("binary_data_size")
    if size is not None and "data" in entry:
        raise BadRequestError(f"input '{name}' has both 'data' and a binary_data_size parameter: send its "
                              "values one way, as JSON 'data' or as binary data, not both")
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise BadRequestError(f"input '{name}': binary_data_size must be a non-negative integer")
        if offset + size > len(binary):
            raise BadRequestError(f"input '{name}': binary_data_size {size} runs past the end of the "
                                  f"body ({len(binary) - offset} bytes of binary data left)")
        return tensor_from_bytes(binary[offset:offset + size], spec.dtype, shape, name), offset + size
    if "data" in entry:
        return tensor_from_json(entry["data"], spec.dtype, shape, name), offset
    raise BadRequestError(f"input '{name}' has neither 'data' nor a binary_data_size parameter")


def decode_outputs(sig: Signature, requested, binary_default: bool) -> list:
    """[(output index, as binary data)] the request asks for (every output when it names none:
    no ``outputs``, or an empty list, which until 12-03 returned no output at all). An output
    named twice is a 400, as an input given twice is."""
    if requested is None or (isinstance(requested, list) and not requested):
        return [(o, binary_default) for o in range(len(sig.output_specs))]
    if not isinstance(requested, list):
        raise BadRequestError("'outputs' must be a list")
    wanted = []
    for out in requested:
        if not isinstance(out, dict) or not isinstance(out.get("name"), str):
            raise BadRequestError("every requested output must be an object with a 'name'")
        o = sig.output_index.get(out["name"])
        if o is None:
            raise BadRequestError(f"unknown output '{out['name']}'; model '{sig.name}' has "
                                  f"{', '.join(repr(s.name) for s in sig.output_specs)}")
        if any(o == seen for seen, _ in wanted):
            raise BadRequestError(f"output '{out['name']}' is requested twice")
        oparams = out.get("parameters") or {}
        if not isinstance(oparams, dict):
            raise BadRequestError(f"output '{out['name']}': 'parameters' must be a JSON object")
        if oparams.get("classification"):
            raise BadRequestError("the classification extension is not supported")
        b = oparams.get("binary_data", binary_default)
        if not isinstance(b, bool):
            raise BadRequestError(f"output '{out['name']}': binary_data must be true or false")
        wanted.append((o, b))
    return wanted


def encode_response(sig: Signature, outs, wanted, req_id) -> tuple:
    """(body, media type, headers) of the infer response: the ``wanted`` outputs as JSON data or
    binary data after the JSON header."""
    entries, blobs = [], []
    for o, binary in wanted:
        t = outs[o]
        entry = {"name": sig.output_specs[o].name, "datatype": DATATYPE_OF[t.dtype],
                 "shape": list(t.shape)}
        if binary:
            data = tensor_to_bytes(t)
            entry["parameters"] = {"binary_data_size": len(data)}
            blobs.append(data)
        else:
            entry["data"] = t.reshape(-1).tolist()
        entries.append(entry)
    body = {"model_name": sig.name, "model_version": "1", "outputs": entries}
    if req_id is not None:
        body["id"] = req_id
    header = json.dumps(body, separators=(",", ":")).encode()
    if not blobs:
        return header, "application/json", {}
    return (header + b"".join(blobs), "application/octet-stream",
            {"Inference-Header-Content-Length": str(len(header))})
