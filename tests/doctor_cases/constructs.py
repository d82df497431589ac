"""One function per construct the doctor must report. Each flagged line ends in `# <kind>`;
the tests find that line by its marker, so editing this file keeps them right."""

import torch
from torch import nn

SCALE = torch.tensor([2.0])
generator = torch.Generator().manual_seed(0)


def item(x):
    return x * x.sum().item()  # host-sync


def tolist(x):
    values = x.tolist()  # host-sync
    return x * len(values)


def to_cpu(x):
    return x.cpu() + 1  # host-sync


def numpy(x):
    return x * float(x.numpy().sum())  # host-sync


def printing(x):
    print(f"x = {x}")  # host-sync
    return x * 2


def branch(x):
    if x.sum() > 0:  # host-sync
        return x * 2
    return x


def synchronize(x):
    torch.cuda.synchronize()  # sync-call
    return x * 2


def nonzero(x):
    return x[x.nonzero()[:, 0]]  # dynamic-shape


def boolean_mask(x):
    return x[x > 0]  # dynamic-shape


def masked_select(x):
    return torch.masked_select(x, x > 0)  # dynamic-shape


def unique(x):
    return torch.unique(x.round())  # dynamic-shape


def repeat_interleave(x):
    return torch.repeat_interleave(x, torch.tensor([1, 2, 1, 2]))  # dynamic-shape


def cpu_constant(x):
    return x + torch.tensor([1.0, 2.0, 3.0, 4.0])  # cpu-tensor


def mutates_input(x):
    x.add_(1)  # input-mutation
    return x * 2


def returns_input(x):  # output-aliases-input
    return x


def reads_global(x):
    return x * SCALE  # closure-tensor


def custom_generator(x):
    return x + torch.rand(x.shape, generator=generator)  # generator


def autocast_cached(x):
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=True):
        return nn.functional.linear(x, torch.ones(4, 4))  # autocast-cache


_model = nn.Linear(4, 4)
_adam = torch.optim.Adam(_model.parameters(), lr=1e-3)


def optimizer_step(x):
    _model(x).sum().backward()
    _adam.step()  # optimizer
    _adam.zero_grad()
    return x


_scaler = torch.amp.GradScaler("cpu")
_sgd = torch.optim.SGD(_model.parameters(), lr=0.1)


def grad_scaler_step(x):
    _scaler.scale(_model(x).sum()).backward()
    _scaler.step(_sgd)  # grad-scaler
    _scaler.update()
    _sgd.zero_grad()
    return x


class Counter:
    def __init__(self):
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        if self.calls % 2:
            return x * 2
        return x.exp()  # control-flow


counter = Counter()
