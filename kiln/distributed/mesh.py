"""NxD's rank layout as arithmetic: which global ranks form each parallel group.

``arange(world).reshape(PP, DP, CP, TP)`` with TP contiguous; expert regions view the
same ranks as ``reshape(PP, DP_exp, EP, TP)``. No process group is needed, so the layout
can be computed (and tested) for any world size in one process.
"""
from __future__ import annotations

import itertools
import operator

from kiln.errors import KilnError



class ParallelSizeError(KilnError, RuntimeError):
    """The world does not divide into the requested parallel degrees (NxD: RuntimeError)."""

class ParallelDegreeError(KilnError, ValueError):
    """A parallel degree that is not a whole number of ranks (0, negative, not an int)."""


OPTION_NAMES = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
                "cp": "context_parallel_size", "ep": "expert_model_parallel_size"}


def _degree(key: str, size) -> int:
    try:
        whole = operator.index(size) if not isinstance(size, bool) else 0
    except TypeError:
        whole = 0
    if whole < 1:
        raise ParallelDegreeError(f"{OPTION_NAMES[key]}={size!r}: expected an int >= 1 (the number of ranks in "
                                  "each such group; 1 turns that parallelism off)")
    return whole


def layout(world: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1) -> tuple:
    """NxD's meshes for a world of ``world`` ranks: ``(sizes, meshes)``, each mesh a list
    of rank lists (the ``*_replica_groups``). Pure arithmetic: no process group needed."""
    tp, pp, cp, ep = (_degree(key, size) for key, size in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)))
    tp, pp, cp, ep = (min(s, world) for s in (tp, pp, cp, ep))
    if world % (tp * pp * cp) != 0:
        raise ParallelSizeError(
            f"invalid implied data parallel degree: `world_size` ({world}) is not divisible by "
            f"tensor_model_parallel_size ({tp}) x pipeline_model_parallel_size ({pp}) x "
            f"context_parallel_size ({cp}); choose degrees whose product divides the number of ranks")
    if world % (tp * pp * ep) != 0:
        raise ParallelSizeError(
            f"invalid implied expert data parallel degree: `world_size` ({world}) is not divisible by "
            f"tensor_model_parallel_size ({tp}) x pipeline_model_parallel_size ({pp}) x "
            f"expert_model_parallel_size ({ep}); choose degrees whose product divides the number of ranks")
    dp = world // (tp * pp * cp)
    edp = world // (tp * pp * ep)

    def at(p, d, c, t):
        return ((p * dp + d) * cp + c) * tp + t

    def at_exp(p, d, e, t):
        return ((p * edp + d) * ep + e) * tp + t
    prod = itertools.product
    meshes = {
        "tp": [[at(p, d, c, t) for t in range(tp)] for p, d, c in prod(range(pp), range(dp), range(cp))],
        "dp": [[at(p, d, c, t) for d in range(dp)] for p, c, t in prod(range(pp), range(cp), range(tp))],
        "cp": [[at(p, d, c, t) for c in range(cp)] for p, d, t in prod(range(pp), range(dp), range(tp))],
        "pp": [[at(p, d, c, t) for p in range(pp)] for d, c, t in prod(range(dp), range(cp), range(tp))],
        "ep": [[at_exp(p, d, e, t) for e in range(ep)] for p, d, t in prod(range(pp), range(edp), range(tp))],
        "edp": [[at_exp(p, d, e, t) for d in range(edp)] for p, e, t in prod(range(pp), range(ep), range(tp))],
        "zero1": [[at(p, d, c, t) for d in range(dp) for c in range(cp)]
                  for p, t in prod(range(pp), range(tp))],
        "world": [list(range(world))],
    }
    sizes = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "ep": ep, "edp": edp, "world": world}
    return sizes, meshes


def sr_pairs(pp_mesh, pp: int) -> list:
    """Every (rank, next rank) pair of each pipeline group (NxD's CPU-mode send/recv groups)."""
    return [[ranks[i], ranks[(i + 1) % pp]] for ranks in pp_mesh for i in range(pp)]


def kv_mesh(tp_groups: list, tp: int, size: int, sequential: bool) -> list:
    """Groups of TP ranks holding the same KV heads: interleaved (NxD trn1) or sequential."""
    if sequential:
        flat = [r for g in tp_groups for r in g]
        return [flat[i:i + size] for i in range(0, len(flat), size)]
    return [g[j::tp // size] for g in tp_groups for j in range(tp // size)]


class UnsupportedOptionError(KilnError, NotImplementedError):
    """An NxD option that exists but kiln does not implement (a Neuron hardware knob such as
    ``tile_cc``, or expert parallelism) was given a non-default value."""


def unsupported(option: str, value, why: str, default=None) -> None:
    """Raise :class:`UnsupportedOptionError` naming ``option`` unless it is at ``default``."""
    if value != default and value is not default:
        raise UnsupportedOptionError(f"{option}={value!r} is not supported by kiln ({why}); "
                                     f"leave {option} at its default {default!r}")
