"""Bounds on the work and memory of rendering a chat template, which comes from the artifact.

jinja's sandbox keeps a template from reaching Python's internals, but not from making a
string of 4 GB (``{{ 'ab' * 2000000000 }}``) or looping 10^10 times (two nested
``range(100000)``): an 80-byte template in an LLM artifact could take a server's memory or
a core for good at its first chat request. Rendering through :func:`guard` bounds each way
a template can make something large, so such a template is an InputError instead:

* the operators ``*``, ``+``, ``**`` and ``%`` on strings, lists and numbers, the filters
  (int arguments and results, ``replace``'s growth), calls (arguments and results, so a
  macro that recurses cannot double a string each level) and values stored in a
  ``namespace`` (the only way a loop carries a value out of an iteration: jinja scopes
  ``set`` to the loop body) are held to :data:`MAX_ITEMS` characters or items, far above a
  real prompt (a 128k-token context is well under 1 Mi characters);
* ``range`` iterations are counted, :data:`MAX_STEPS` a render.
"""
from __future__ import annotations

import functools
import math
import re
import threading

from kiln.errors import InputError

MAX_ITEMS = 1 << 24          # characters or items one value a template makes may hold (16 Mi)
MAX_STEPS = 1 << 20          # range() iterations one render may take
MAX_POWER_BITS = 1 << 16     # the largest number ** may make, in bits
_render = threading.local()
_FORMAT_WIDTH = re.compile(r"%[-+ #0]*(\*|\d+)")


def refuse(what: str):
    raise InputError(f"the chat template tried to make {what}; kiln renders templates within {MAX_ITEMS} "
                     f"characters or items a value and {MAX_STEPS} range() steps: this one is not a chat format")


def sized(value, what: str = "a value"):
    if isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > MAX_ITEMS:
        refuse(f"{what} of {len(value)} characters or items")
    return value


def start():
    """Called before each render: a fresh budget of range() steps for this thread."""
    _render.steps = MAX_STEPS


def binop(table, operator: str, left, right):
    """``left operator right`` (jinja's ``call_binop``), refused where the result would be too big."""
    if operator == "*":
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_ITEMS:
            refuse(f"a {type(seq).__name__} of {len(seq) * n} items by *")
    elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)) and \
            len(left) + len(right) > MAX_ITEMS:
        refuse(f"a value of {len(left) + len(right)} items by +")
    elif operator == "**" and isinstance(left, (int, float)) and isinstance(right, (int, float)) and \
            abs(left) > 1 and right * math.log2(abs(left)) > MAX_POWER_BITS:
        refuse(f"a number of about {int(right * math.log2(abs(left)))} bits by **")
    elif operator == "%" and isinstance(left, str):
        widths = [m.group(1) for m in _FORMAT_WIDTH.finditer(left)]
        args = right if isinstance(right, tuple) else (right,)
        if any(w != "*" and int(w) > MAX_ITEMS for w in widths) or \
                ("*" in widths and any(isinstance(a, int) and a > MAX_ITEMS for a in args)):
            refuse("a formatted string wider than the limit by %")
    return sized(table[operator](left, right), f"a value made by {operator}")


def filtered(name: str, fn):
    """A filter whose int arguments (widths, counts) and result are held to the limit."""
    @functools.wraps(fn)
    def bounded(*args, **kwargs):
        if any(isinstance(a, int) and not isinstance(a, bool) and a > MAX_ITEMS for a in (*args, *kwargs.values())):
            refuse(f"a value by the filter {name} with an argument above {MAX_ITEMS}")
        return sized(fn(*args, **kwargs), f"a value by the filter {name}")
    return bounded


def replace(fn):
    """``replace``: its growth is known before it runs (a 16 Mi string times a long ``new``)."""
    @functools.wraps(fn)
    def bounded(eval_ctx, s, old, new, count=None):
        if isinstance(s, str) and isinstance(old, str) and isinstance(new, str) and old and len(new) > len(old):
            grows = s.count(old) if count is None else min(count, s.count(old))
            if len(s) + grows * (len(new) - len(old)) > MAX_ITEMS:
                refuse("a string by the filter replace")
        return fn(eval_ctx, s, old, new, count)
    return bounded


class Steps:
    """A ``range`` whose iterations are counted against the render's budget."""

    def __init__(self, r: range):
        self.r = r

    def __iter__(self):
        for i in self.r:
            _render.steps -= 1
            if _render.steps < 0:
                refuse(f"more than {MAX_STEPS} range() steps")
            yield i

    def __len__(self):
        return len(self.r)

    def __getitem__(self, k):
        v = self.r[k]
        return Steps(v) if isinstance(v, range) else v

    def __reversed__(self):
        return iter(Steps(self.r[::-1]))

    def __contains__(self, x):
        return x in self.r


def counted_range(safe_range):
    return lambda *args: Steps(safe_range(*args))
