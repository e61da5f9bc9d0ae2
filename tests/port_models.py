"""Models for ``kiln port``'s tests, in a file of their own so the tests can find the lines
the blockers must name (``kiln port tests/port_models.py:tier2`` is the file spelling)."""
import torch
from torch import nn


class HostOpAndBranch(nn.Module):
    """Tier 2: an op no engine runs (median) and a branch on a tensor's value."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        m = torch.median(h, dim=-1).values
        if m.sum() > 0:
            h = h * 2
        return self.b(h) + m.unsqueeze(-1)


class ValueShaped(nn.Module):
    """An output whose shape depends on values (nonzero)."""

    def forward(self, x):
        idx = torch.nonzero(x > 0)
        return idx.sum(dim=0).float() + x.sum()


def tier2():
    torch.manual_seed(0)
    return HostOpAndBranch().eval(), torch.randn(2, 8)


def value_shaped():
    torch.manual_seed(0)
    return ValueShaped().eval(), torch.randn(4, 3)
