"""A torch-neuronx training script in the shape of Neuron's mnist_mlp sample (synthetic
data): torch_xla's imports, MpDeviceLoader, xm.optimizer_step, xm.save, metrics report.
Run by tests/test_device_xla.py unchanged through `kiln run-xla`, or on a real Neuron host."""
import argparse
import os

import torch
import torch.nn as nn
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.distributed.parallel_loader as pl


class MLP(nn.Module):
    def __init__(self, input_size=28 * 28, output_size=10, layers=(120, 84)):
        super().__init__()
        self.fc1 = nn.Linear(input_size, layers[0])
        self.fc2 = nn.Linear(layers[0], layers[1])
        self.fc3 = nn.Linear(layers[1], output_size)

    def forward(self, x):
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return torch.log_softmax(self.fc3(x), dim=1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--out", default="checkpoint.pt")
    args = parser.parse_args()
    torch.manual_seed(0)
    images = torch.randn(args.steps * args.batch, 28 * 28)
    labels = torch.randint(0, 10, (args.steps * args.batch,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=args.batch)

    device = xm.xla_device()
    model = MLP().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.NLLLoss()
    losses = []
    model.train()
    for x, y in pl.MpDeviceLoader(loader, device):
        optimizer.zero_grad()
        loss = loss_fn(model(x.view(x.size(0), -1)), y)
        loss.backward()
        xm.optimizer_step(optimizer)
        losses.append(loss.detach())
        xm.add_step_closure(lambda l=loss: None)
    xm.master_print("losses " + " ".join(f"{float(l):.6f}" for l in losses))
    xm.save({"state_dict": model.state_dict()}, args.out)
    print(met.metrics_report())
    print("world", xm.xrt_world_size(), "ordinal", xm.get_ordinal(), "master", xm.is_master_ordinal())


if __name__ == "__main__":
    main()
