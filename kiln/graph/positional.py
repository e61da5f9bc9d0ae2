"""The wrapper a model is exported through (its named example arguments passed
positionally), and how many of them a call of the compiled model may give positionally."""
from __future__ import annotations

import inspect

import torch


class Positional(torch.nn.Module):
    """Calls the model with named arguments passed positionally to export.

    Exporting through this wrapper gives the graph one input per flat tensor
    in exactly ``bind_inputs``' order, whatever mix of positional and
    keyword arguments the user's example used.

    A scalar argument (a bool, int, float or string) reaches the model as the example gave
    it: the graph holds it fixed (calls are checked against it), and torch.export hands a
    bool input to ``forward`` as the int 1, which transformers reads in
    ``output_hidden_states=1`` as "hidden state 1 alone". Until 12-03 an example with
    ``output_hidden_states=True`` was refused with a wrong reason (non-tensor outputs).
    """

    def __init__(self, model, names, n_positional, example=()):
        super().__init__()
        self.model = model
        self.names = names
        self.n_positional = n_positional      # the first names go positionally (*args)
        self.scalars = {i: v for i, v in enumerate(example) if isinstance(v, (bool, int, float, str))}

    def forward(self, *values):
        values = [self.scalars.get(i, v) for i, v in enumerate(values)]
        n = self.n_positional
        return self.model(*values[:n], **dict(zip(self.names[n:], values[n:])))


def prefix(model, names) -> int | None:
    """How many of ``names`` (the traced inputs, in signature order) a call of the compiled
    model may give positionally: the leading ones that are the forward's own leading
    positional parameters. Past a parameter the trace left at its default
    (``forward(a, b, c=None, d=None)`` traced with ``a, b, d``; a BERT traced with
    ``input_ids`` and ``token_type_ids``), eager's next positional is that parameter, not the
    next traced input: until 12-03 ``compiled(a, b, x)`` took ``x`` as ``d`` (found by
    probing). None where the signature cannot be read or takes ``*args``."""
    fn = model.forward if isinstance(model, torch.nn.Module) else model
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return None
    count = 0
    for name, p in zip(names, params):
        if p.name != name or p.kind not in (inspect.Parameter.POSITIONAL_ONLY,
                                            inspect.Parameter.POSITIONAL_OR_KEYWORD):
            break
        count += 1
    return count
