"""AOTInductor's C++ wrapper without the input checks kiln never runs.

AOTInductor writes one C++ function per graph input that checks its dtype, sizes, strides
and device (``check_input_N``, about 55 lines each), and calls them only in a process that
sets ``AOTI_RUNTIME_CHECK_INPUTS``. kiln checks every call's inputs itself before an engine
sees them (:meth:`kiln.runtime.model.Model.check`: shapes and dtypes; a device program is
found by the shapes and dtypes it was recorded with; the Inductor runner hands inputs over
in the layout they were compiled in, kiln.engines.inductor), so for kiln they are dead code, and yet the
wrapper is compiled with them: a BERT-4L training step's 260 inputs made 14,000 of its
wrapper's 19,700 lines, and the wrapper's g++ build (at -O1) took 27 s of that step's 67 s
Inductor build (11-29, 2 cores).

While kiln compiles, the wrapper is generated without them: ``__check_inputs_outputs``
(which the generated ``run_impl`` calls) is left empty, and the switch other generated
code tests, ``_check_aoti_runtime_check_inputs_env``, is kept as torch writes it. This
swaps a method of torch 2.13's code generator (``CppWrapperCpu``, whose GPU wrapper
inherits it) for the length of the compile; a torch without that method compiles as is.
The swap is process-wide: an AOTInductor build another thread makes meanwhile (a user's
own) is generated without the checks too.
"""
from __future__ import annotations

import contextlib

from kiln.swap import Swap

_CHECKS_OFF = """
    static bool _check_aoti_runtime_check_inputs_env() {
        const static char* env_var_value = getenv("AOTI_RUNTIME_CHECK_INPUTS");
        const static bool result = env_var_value != nullptr && env_var_value[0] != '0';
        return result;
    }

    AOTI_NOINLINE static void __check_inputs_outputs(
        AtenTensorHandle* input_handles,
        AtenTensorHandle* output_handles) {
        // kiln checks the inputs before every call (kiln.engines.inductor_lean)
    }
"""


def _without_checks(self):
    self.prefix.splice_aot(_CHECKS_OFF)


_SWAP = Swap(lambda original: _without_checks)


def without_input_checks():
    """Generate AOTInductor wrappers without per-input check functions inside."""
    try:
        from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    except ImportError:
        return contextlib.nullcontext()
    if "generate_input_output_runtime_checks" not in CppWrapperCpu.__dict__:
        return contextlib.nullcontext()
    return _SWAP.held(CppWrapperCpu, "generate_input_output_runtime_checks")
