"""The wrapper a model is exported through: its named example arguments passed positionally."""
from __future__ import annotations

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
