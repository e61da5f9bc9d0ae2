"""Tiny test models, importable by tests and by CLI subprocesses (``tests.models:factory``)."""
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


@torch.library.custom_op("kilntest::odd_scale", mutates_args=())
def odd_scale(x: torch.Tensor) -> torch.Tensor:
    """An op no engine knows: forces host fallback."""
    return x * 2.0 + 1.0


@odd_scale.register_fake
def _(x):
    return torch.empty_like(x)


class WithCustomOp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = odd_scale(h)
        return self.b(h)


class Pytree(nn.Module):
    """Nested inputs and outputs."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, pair, extras, scale=None):
        a, b = pair
        y = self.lin(a) + b * extras["w"]
        return {"y": y, "stats": [y.mean(), y.amax(dim=-1)], "none": None}


def tiny_bert_config(**kw):
    from transformers import BertConfig
    cfg = dict(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
               intermediate_size=64, max_position_embeddings=64)
    cfg.update(kw)
    return BertConfig(**cfg)


def tiny_bert():
    from transformers import BertModel
    torch.manual_seed(0)
    return BertModel(tiny_bert_config()).eval()


def bert_inputs(batch=2, seq=16):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 120, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[-1, seq // 2:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def tiny_resnet():
    from transformers import ResNetConfig, ResNetModel
    torch.manual_seed(0)
    cfg = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                       layer_type="basic")
    return ResNetModel(cfg).eval()


# -- factories for the CLI: return (model, example_inputs) ---------------------

def mlp():
    torch.manual_seed(0)
    return MLP().eval(), torch.randn(2, 16)


def cnn():
    torch.manual_seed(0)
    return CNN().eval(), torch.randn(1, 3, 16, 16)


def bert():
    return tiny_bert(), bert_inputs()


def custom_op():
    torch.manual_seed(0)
    return WithCustomOp().eval(), torch.randn(2, 8)
