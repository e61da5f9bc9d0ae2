"""``neuronx_distributed.utils.activation_checkpoint``: recompute chosen submodules' forwards
during backward instead of keeping their activations.

``checkpoint_wrapper(module)`` wraps the module's forward in place (non-reentrant
``torch.utils.checkpoint``, RNG state restored: :func:`kiln.distributed.trainer.apply_activation_checkpointing`),
so parameter and state-dict names stay as they were, which NxD's checkpoints and
kiln's tensor-parallel loaders rely on. ``apply_activation_checkpointing`` applies a
wrapper to every submodule ``check_fn`` accepts, putting what the wrapper returns in the
module's place (the module itself for kiln's wrapper).
"""
from __future__ import annotations

from kiln.distributed import trainer


def checkpoint_wrapper(module, checkpoint_impl=None, checkpoint_fn=None, **kwargs):
    """``module``, its forward recomputed during backward; NxD's ``checkpoint_impl`` and
    ``checkpoint_fn`` choices (reentrant or not, torch_xla's function) are one here."""
    return trainer.apply_activation_checkpointing(module, check_fn=lambda m: m is module, include_root=True)


def apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda _: True,
                                   **kwargs):
    """Wrap each submodule of ``model`` that ``check_fn`` accepts (not ``model`` itself, not
    one inside a module already wrapped) with ``checkpoint_wrapper_fn``; returns ``model``."""
    def visit(parent):
        for name, child in list(parent.named_children()):
            if check_fn(child):
                wrapped = checkpoint_wrapper_fn(child)
                if wrapped is not child:
                    setattr(parent, name, wrapped)
            else:
                visit(child)
    visit(model)
    return model
