"""Checks of a call's input *values* (shapes and dtypes are the model's own check), made
before any engine sees them, where engines would answer otherwise than eager PyTorch:

* an index out of the range eager accepts (:mod:`kiln.graph.index_ranges` records which
  inputs index what, at compile time): eager raises ``IndexError``, OpenVINO answers zeros,
  an AOTInductor kernel ends the process. Refused with :class:`IndexRangeError`, an
  ``IndexError`` too, as eager's is.
* NaN and infinities where an engine of the model was found at compile time to answer
  them otherwise (:func:`kiln.compiler.checks.nonfinite_probe`).
* a keyword the example call left to its default, given explicitly (:func:`explicit_default`).
* an LLM prompt's token ids that are not integers (:func:`token_ids`), prompts that are
  not a batch of them (:func:`prompt_batch`), a count that is not an integer
  (:func:`count`).
"""
from __future__ import annotations

import numbers
from collections.abc import Iterable

import numpy as np
import torch

from kiln.errors import IndexRangeError, InputError


def explicit_default(name: str, value, manifest: dict) -> bool:
    """Whether ``name=value``, not among the compiled inputs, may be dropped: it is a parameter
    the trace left to its default (``manifest["omitted_defaults"]``) and ``value`` equals that
    default (same type and value; an int for a float alike), so the graph computed with it. A different value is an
    :class:`InputError` saying so; a name that is no such parameter is False (the caller's
    "unexpected input")."""
    defaults = manifest.get("omitted_defaults") or {}
    if not isinstance(defaults, dict) or name not in defaults:
        return False
    default = defaults[name]
    same_kind = type(value) is type(default) or all(type(v) in (int, float) for v in (value, default))
    if value is default or (same_kind and not isinstance(value, (torch.Tensor, np.ndarray)) and value == default):
        return True
    shown = f"a tensor {tuple(value.shape)}" if isinstance(value, (torch.Tensor, np.ndarray)) else repr(value)
    raise InputError(f"input '{name}' is {shown}, but the model was compiled with {name} left to its "
                     f"default {default!r}, which the compiled graph holds fixed: pass {name}={default!r} "
                     f"or leave it out, or trace with {name} given to compile it as an input")


def ranges(tensor_dicts: list) -> list:
    """``(position, name, low, high, operator, exempt)`` of each input a manifest gives a
    range (``exempt``: a value allowed besides, a loss's ``ignore_index``, or None)."""
    return [(i, d["name"], int(r[0]), int(r[1]), str(r[2]), int(r[3]) if len(r) == 4 else None)
            for i, d in enumerate(tensor_dicts)
            if isinstance(r := d.get("range"), list) and len(r) in (3, 4)]


def check_ranges(flat, checked: list) -> None:
    """Raise :class:`IndexRangeError` where an input of ``checked`` (:func:`ranges`) holds
    an index out of its range: one min and one max per such input."""
    for i, name, low, high, what, exempt in checked:
        t = flat[i]
        if not isinstance(t, torch.Tensor) or t.numel() == 0 or t.device.type == "meta":
            continue
        if exempt is not None:
            t = t[t != exempt]
            if t.numel() == 0:
                continue
        least, most = (int(v) for v in torch.aminmax(t))         # one pass
        if least < low or most >= high:
            bad = least if least < low else most
            size = high
            raise IndexRangeError(
                f"input '{name}' holds {bad}, out of range for the dimension of {size} it indexes "
                f"({what}: {low} <= i < {high}{f', or {exempt}' if exempt is not None else ''}), where "
                "PyTorch raises IndexError; engines answer such "
                "an index otherwise (OpenVINO with zeros, ONNX Runtime from the end), so "
                "kiln refuses it. A token id beyond the vocabulary, or a position beyond the "
                "table, is the usual cause")


def nonfinite_in(t, nonfinite) -> list:
    """Which of ``nonfinite`` ("nan", "+inf", "-inf") the tensor ``t`` holds (a non-float or
    meta tensor none)."""
    # A finite sum proves every element finite (a NaN or an infinity makes any sum
    # non-finite), in one pass without a mask: an LLM's 8-row decode step's 60 cache
    # inputs took 19 ms so against 140 ms with isfinite().all() (1 thread). A sum that
    # is not finite (a NaN, an infinity, or finite values that overflow) is looked at
    # element by element below.
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.device.type == "meta" \
            or bool(torch.isfinite(t.detach().sum())):
        return []
    return [k for k, test in (("nan", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf))
            if k in nonfinite and bool(test(t).any())]


def any_nonfinite(tensors, nonfinite) -> bool:
    """Whether any of ``tensors`` holds a value in ``nonfinite``: one stacked check of every
    float tensor's sum first (300 tensors of 70,000 floats, about a 4-layer BERT step's inputs:
    7.5 ms against 12 ms one tensor at a time, 2 threads), each tensor looked at
    only when that finds something."""
    floats = [t.detach() for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()
              and t.device.type != "meta" and t.numel()]
    if not floats or bool(torch.isfinite(torch.stack([t.sum().float() for t in floats])).all()):
        return False
    return any(nonfinite_in(t, nonfinite) for t in floats)


def check_nonfinite(flat, input_specs, nonfinite) -> None:
    """Raise ``InputError`` where a float input holds a value in ``nonfinite``."""
    if not nonfinite:
        return
    for t, spec in zip(flat, input_specs):
        found = nonfinite_in(t, nonfinite)
        if found:
            raise InputError(
                f"input '{spec.name}' holds {' and '.join(found)}: an engine of this model was "
                "found at compile time not to give PyTorch's answer for such values (NaN, and "
                "the NaN that infinities make, through ReLU or max comes out as a number), so "
                "kiln refuses them rather than answer differently. Replace them, or compile "
                "with another engine (engine=...)")


def token_ids(prompt) -> list:
    """``prompt`` as a list of Python ints, or :class:`InputError` where a token is not an
    integer (a Python or NumPy int, or an integer tensor): ``int()`` alone cut a float id
    (``1.5``) to another token, and the request answered for another prompt."""
    if isinstance(prompt, torch.Tensor):
        if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
            raise InputError(f"token ids must be integers; the prompt is a {prompt.dtype} tensor")
        if prompt.dim() != 1:
            raise InputError(f"a prompt is one row of token ids; got a tensor of shape {tuple(prompt.shape)}")
        return prompt.tolist()
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Iterable):
        raise InputError(f"a prompt is a list of token ids; got {prompt!r} ({type(prompt).__name__})")
    out = []
    for t in prompt:
        if not _integer_id(t):
            raise InputError(f"token ids must be integers; the prompt holds {t!r} ({type(t).__name__})")
        out.append(int(t))
    return out


def _integer_id(t) -> bool:
    if isinstance(t, torch.Tensor):
        return t.dim() == 0 and not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def prompt_batch(prompts) -> list:
    """``LLM.generate``'s prompts as a list of token-id lists, or :class:`InputError`. A
    list of prompts, or a 2-D integer tensor or array whose every row is one whole prompt
    (``[batch, tokens]``, no padding: padded rows go to ``hf_generate`` with their
    ``attention_mask``). A flat list of ids (or a 1-D tensor) is refused, naming the
    spelling, rather than read as one prompt: ``generate`` returns one list of new tokens
    per prompt, and a flat input would leave which shape comes back a guess."""
    if isinstance(prompts, np.ndarray):
        prompts = torch.from_numpy(prompts) if prompts.dtype != object else list(prompts)
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2:
            raise InputError(f"prompts as a tensor are [batch, tokens], a row per prompt; got shape "
                             f"{tuple(prompts.shape)}" + (" (one prompt is [1, tokens])" if prompts.dim() == 1 else ""))
        prompts = list(prompts)
    elif isinstance(prompts, (str, bytes, dict)) or not isinstance(prompts, Iterable):
        raise InputError(f"prompts are a list of prompts, each a list of token ids; got {type(prompts).__name__}")
    prompts = list(prompts)
    if not prompts:
        raise InputError("give at least one prompt")
    if all(_integer_id(t) for t in prompts):
        raise InputError(f"prompts are a list of prompts, each a list of token ids; got one flat list of ids: "
                         f"for one prompt give [{_shown(prompts)}]")
    return [token_ids(p) for p in prompts]


def _shown(ids) -> str:
    return "[" + ", ".join(str(int(t)) for t in ids[:4]) + (", ...]" if len(ids) > 4 else "]")


def count(value, name: str) -> int:
    """``value`` as an int, or :class:`InputError` where it is not an integer (a Python or
    NumPy int): ``max_new_tokens=2.5`` gave 3 tokens from ``generate`` and 2 from
    ``hf_generate``, ``True`` gave 1, a string a TypeError."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    raise InputError(f"{name} must be an integer; got {value!r} ({type(value).__name__})")


def positional(model: str, names: list, count: int | None, given: int) -> None:
    """Refuse more positional arguments than the ``count`` leading inputs the forward itself
    takes positionally (:func:`kiln.graph.positional.prefix`): past a parameter the trace
    left at its default, a positional argument means that parameter to the model."""
    if count is None or given <= count:
        return
    taken = f" ({', '.join(names[:count])})" if count else ""
    raise InputError(f"{model} takes {count} positional input(s){taken}, got {given}: its forward has a "
                     "parameter there that was left at its default when it was compiled, so a positional "
                     "argument would not mean what it means to the model. Pass "
                     f"{', '.join(names[count:])} by keyword")
