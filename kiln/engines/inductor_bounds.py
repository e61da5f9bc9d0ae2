"""An index out of range inside an Inductor CPU kernel: an error the run returns, not the
end of the process.

Inductor's C++ kernels check an index they read from a tensor (``gather``, ``scatter``,
``x[i]``, ``index_put``) where its value ranges cannot prove it in bounds, with
``AOTI_TORCH_CHECK(0 <= tmp && tmp < size, ...)`` inside the kernel's loop. That loop is
an OpenMP parallel region, and a C++ exception cannot leave one: the throw calls
``std::terminate`` and the process ends ("terminate called after throwing an instance of
'c10::Error'", exit 134). kiln checks the range of an index that is a graph *input*
before any engine sees it (:mod:`kiln.graph.index_ranges`), but not one the graph
computes: a device program's ``topk`` indices gathering from a narrower tensor, or
``-1 - i`` indexing rows, ended the process on the first values that took them out of
range, where eager PyTorch raises ``IndexError``; and the compile's own NaN/infinity probe
(:func:`kiln.compiler.checks.nonfinite_probe`) made such values on purpose (a NaN sorts
last), so a program compiled in line ended the process on good values (12-01).

While kiln compiles, each such check is generated the way torch 2.13 treats an integer
division by zero in the same kernels: the failure is noted in the kernel's own atomic
flag (``inductor_cpu_integer_div_error``, which every CPU kernel declares), the index
is replaced by 0 where it is computed, before any copy of it (a vector kernel reads its
lanes from an array copy), so that the element's load or store stays inside the tensor, and after
the parallel region the kernel raises (a value of 2 in that flag: an index; torch's 1 stays a
division by zero). The run then fails with a ``RuntimeError`` (the AOTInductor runtime
turns an exception into an error code outside the region), which kiln raises; the
device then runs the program op by op and the caller gets eager's own error
(:func:`kiln.device.programs._op_by_op_after`). Kernels without such a check are generated
as torch writes them. The swap is process-wide while it is held, like
:mod:`kiln.engines.inductor_lean`'s; a torch whose code generator lacks these methods
compiles as is.
"""
from __future__ import annotations

import contextlib
import re

from kiln.swap import Swap

_ASSERT = re.compile(r'(AOTI_TORCH_CHECK|TORCH_CHECK)\((.*), "index out of bounds: (.*)"\);?')
_FLAG = "inductor_cpu_integer_div_error"
_NOTED = "/* kiln: index out of range */"
_THROW = f"inductor_cpu_throw_if_integer_div_error({_FLAG});"


def noted(line: str, index: str) -> str | None:
    """The kernel line that notes a failed check and zeroes ``index``, for Inductor's
    assert ``line``; None for a line that is not an index assert."""
    stripped = line.strip()
    m = _ASSERT.fullmatch(stripped)
    if m is None:
        return None
    indent = line[:len(line) - len(line.lstrip())]
    return (f"{indent}if (!({m.group(2)})) {{ {_NOTED} {_FLAG}.store(2, std::memory_order_relaxed); "
            f"{index} = decltype({index})(0); }}")


def raised(code: str) -> str:
    """A kernel's code that raises, after its parallel region, where a check noted an index."""
    if _NOTED not in code or _THROW not in code:
        return code
    check = "AOTI_TORCH_CHECK" if "AOTI_TORCH_CHECK" in code else "TORCH_CHECK"
    return code.replace(_THROW, f"if ({_FLAG}.load(std::memory_order_acquire) == 2) {{ {check}(false, "
                                f"\"index out of range: an index this kernel read is outside its tensor\"); }} "
                                + _THROW)


def _bounds(original):
    def check_bounds(self, expr, size, lower, upper):
        import sympy
        from torch.utils._sympy.symbol import SymT, symbol_is_type
        from torch._inductor.virtualized import V
        var = self.cse.varname_map.get(str(expr)) if isinstance(expr, sympy.Symbol) else None
        if not (lower or upper) or var is None or not symbol_is_type(expr, SymT.TMP):
            return original(self, expr, size, lower, upper)
        # the index itself, checked and zeroed before torch's check makes copies of it (a
        # vector kernel reads its lanes from an array copied there: zeroing the index after
        # the copy left the access out of range, and a scatter wrote past its tensor)
        size_str = V.kernel.sexpr(self.rename_indexing(size)) if upper else None
        first = noted(self.indirect_assert(var, "0" if lower else None, size_str, self._load_mask), str(expr))
        if first is not None:
            V.kernel.compute.writeline(first)
        buffers = list({id(V.kernel.compute): V.kernel.compute, id(self.loads): self.loads}.values())
        before = [len(b._lines) for b in buffers]
        original(self, expr, size, lower, upper)
        for buffer, n in zip(buffers, before):         # torch's own check, on a copy: noted too
            for k in range(n, len(buffer._lines)):
                line = buffer._lines[k]
                if isinstance(line, str):
                    replaced = noted(line, str(expr))
                    if replaced is not None:
                        buffer._lines[k] = replaced
    return check_bounds


def _group(original):
    def codegen_group(self, *args, **kwargs):
        return raised(original(self, *args, **kwargs))
    return codegen_group


_BOUNDS = Swap(_bounds)
_GROUP = Swap(_group)


@contextlib.contextmanager
def index_errors_raised():
    """Generate Inductor CPU kernels whose failed index checks raise after the parallel
    region instead of inside it (module doc)."""
    try:
        from torch._inductor.codegen.cpp import CppKernel, KernelGroup
    except ImportError:
        yield
        return
    if "check_bounds" not in CppKernel.__dict__ or "codegen_group" not in KernelGroup.__dict__:
        yield
        return
    with _BOUNDS.held(CppKernel, "check_bounds"), _GROUP.held(KernelGroup, "codegen_group"):
        yield
