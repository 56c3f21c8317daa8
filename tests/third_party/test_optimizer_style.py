"""Tests in the style of schedulefree's suite: plain pytest functions over optimizers, with
value asserts. Collected as they are, and run under plain pytest and ``--vram-report`` by
test_third_party_parity.py."""

import pytest
import torch

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.05),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.05, weight_decay=0.0),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_converges_on_a_quadratic(name):
    torch.manual_seed(0)
    target = torch.randn(16)
    x = torch.zeros(16, requires_grad=True)
    optimizer = OPTIMIZERS[name]([x])
    for _ in range(300):
        optimizer.zero_grad()
        loss = ((x - target) ** 2).sum()
        loss.backward()
        optimizer.step()
    assert loss.item() < 1e-3


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_dict_round_trip(name):
    model = torch.nn.Linear(8, 4)
    optimizer = OPTIMIZERS[name](model.parameters())
    model(torch.randn(5, 8)).sum().backward()
    optimizer.step()
    again = OPTIMIZERS[name](model.parameters())
    again.load_state_dict(optimizer.state_dict())
    for state, loaded in zip(optimizer.state.values(), again.state.values(), strict=True):
        for key, value in state.items():
            if torch.is_tensor(value):
                assert torch.equal(value, loaded[key])


def test_sgd_step_matches_the_formula():
    weight = torch.tensor([1.0, -2.0], requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=0.5)
    (weight**2).sum().backward()
    optimizer.step()
    torch.testing.assert_close(weight.detach(), torch.tensor([0.0, 0.0]))


def test_parameter_shapes_are_kept():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    shapes = [p.shape for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    assert [p.shape for p in model.parameters()] == shapes
