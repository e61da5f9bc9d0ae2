"""Walking an operation's arguments and results.

They nest only in tuples, lists and (keyword) dicts. These walk them without
``torch.utils._pytree``'s generality, which costs about 30 µs an operation: the
dispatcher runs them for every operation it records.
"""
from __future__ import annotations

import copy


def leaves(tree):
    """Every non-container value in ``tree``, in order."""
    if isinstance(tree, (list, tuple)):
        for a in tree:
            yield from leaves(a)
    elif isinstance(tree, dict):
        for a in tree.values():
            yield from leaves(a)
    else:
        yield tree


def tmap(fn, tree):
    """``tree`` with ``fn`` applied to each leaf; lists stay lists, tuples become tuples."""
    if isinstance(tree, (list, tuple)):
        items = [tmap(fn, a) for a in tree]
        return items if type(tree) is list else tuple(items)
    if isinstance(tree, dict):
        return {k: tmap(fn, a) for k, a in tree.items()}
    return fn(tree)


def rebuild(tree, fn, select):
    """``tree`` (a checkpoint, a batch: any nesting of containers) with each value ``select``
    accepts replaced by ``fn(value)``. Unlike :func:`tmap` it keeps what the containers are:
    a dict is copied and its items set (its type and attributes stay: an ``OrderedDict``
    state dict's ``_metadata``, a ``ModelOutput``'s fields), lists stay lists, tuples and
    named tuples their types, sets sets."""
    if select(tree):
        return fn(tree)
    if isinstance(tree, dict):
        out = copy.copy(tree)
        for k, v in tree.items():
            out[k] = rebuild(v, fn, select)
        return out
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(rebuild(v, fn, select) for v in tree))
    if isinstance(tree, (list, tuple, set)):
        return type(tree)(rebuild(v, fn, select) for v in tree)
    return tree
