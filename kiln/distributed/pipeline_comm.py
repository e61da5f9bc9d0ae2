"""Point-to-point transfers between neighbouring pipeline ranks (``torch.distributed``
send/recv over the pipeline group: gloo on CPUs, kiln's ``"xla"`` group on its device).

A value crossing a cut may be any nest of tuples, lists and dicts of tensors and
constants (a decoder layer that returns ``(hidden, attn_weights)``). The sender flattens
it with torch's pytree; with the first microbatch of a run it first sends a small
pickled header (the tree structure, each tensor's dtype, shape and ``requires_grad``, and
the constants), so the receiver can allocate buffers; later microbatches of the run have
the same shapes (a batch is split evenly) and send tensors only. Sends are ``isend``\\ s
whose handles are kept until :meth:`PeerLink.wait_sends`, so a rank never blocks on a
neighbour that is itself sending.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree


@dataclass
class Leaf:
    """One leaf of a value: a tensor's description, or a constant carried in the header."""
    is_tensor: bool
    dtype: torch.dtype | None = None
    shape: tuple = ()
    requires_grad: bool = False
    constant: object = None


def _dump_spec(spec):
    """A tree structure for the header: pytree's own serialisation, or the spec itself for
    a container type pytree cannot serialise (pickled with the header)."""
    try:
        return ("json", pytree.treespec_dumps(spec))
    except Exception:           # noqa: BLE001 - any unserialisable node type
        return ("spec", spec)


def _load_spec(dumped):
    kind, spec = dumped
    return pytree.treespec_loads(spec) if kind == "json" else spec


def _describe(value) -> tuple[list, object, list]:
    leaves, spec = pytree.tree_flatten(value)
    tensors, described = [], []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            described.append(Leaf(True, leaf.dtype, tuple(leaf.shape), bool(leaf.requires_grad)))
        else:
            described.append(Leaf(False, constant=leaf))
    return tensors, _dump_spec(spec), described


class PeerLink:
    """Sends to and receives from the previous and next pipeline ranks (global ranks)."""

    def __init__(self, group, prev_rank: int | None, next_rank: int | None, device: torch.device):
        self.group = group
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.device = device
        self._pending: list = []

    # -- low level ---------------------------------------------------------------------
    def _isend(self, tensor: torch.Tensor, dst: int):
        tensor = tensor.detach().contiguous()
        self._pending.append((dist.isend(tensor, dst, group=self.group), tensor))

    def _recv(self, shape, dtype, src: int) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buffer, src, group=self.group)
        return buffer

    def _send_object(self, obj, dst: int):
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self._isend(torch.tensor([data.numel()], dtype=torch.int64), dst)
        self._isend(data, dst)

    def _recv_object(self, src: int):
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src, group=self.group)
        data = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(data, src, group=self.group)
        return pickle.loads(data.numpy().tobytes())

    def wait_sends(self):
        """Wait for every send still in flight (their buffers may then be freed)."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()

    # -- forward: values to the next rank -----------------------------------------------
    def send_forward(self, values: list, with_header: bool) -> list[torch.Tensor]:
        """Send ``values`` to the next rank; the tensors that require grad, in send order
        (their gradients come back in that order)."""
        header, grad_outputs, queued = [], [], []
        for value in values:
            tensors, spec, described = _describe(value)
            header.append((spec, described))
            grad_outputs.extend(t for t in tensors if t.requires_grad)
            queued.extend(tensors)
        if with_header:
            self._send_object(header, self.next_rank)
        for tensor in queued:
            self._isend(tensor, self.next_rank)
        return grad_outputs

    def recv_forward(self, header) -> tuple[list, list[torch.Tensor], object]:
        """The values the previous rank sent, the received tensors that require grad (leaves
        of this stage's graph, whose ``.grad`` goes back), and the header (to reuse)."""
        if header is None:
            header = self._recv_object(self.prev_rank)
        values, grad_inputs = [], []
        for spec, described in header:
            leaves = []
            for leaf in described:
                if not leaf.is_tensor:
                    leaves.append(leaf.constant)
                    continue
                tensor = self._recv(leaf.shape, leaf.dtype, self.prev_rank)
                if leaf.requires_grad:
                    tensor.requires_grad_(True)
                    grad_inputs.append(tensor)
                leaves.append(tensor)
            values.append(pytree.tree_unflatten(leaves, _load_spec(spec)))
        return values, grad_inputs, header

    # -- backward: gradients to the previous rank ---------------------------------------
    def send_backward(self, inputs: list[torch.Tensor]):
        """Send the gradients of the received inputs back (zeros where one got none)."""
        for tensor in inputs:
            grad = tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
            self._isend(grad, self.prev_rank)

    def recv_backward(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients of ``outputs`` from the next rank."""
        return [self._recv(tuple(t.shape), t.dtype, self.next_rank) for t in outputs]
