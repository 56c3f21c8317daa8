"""Tests in the style of torchdiffeq's suite: unittest.TestCase classes that loop over
devices, dtypes and solvers inside ``self.subTest``, with value asserts. Collected as they
are, and run under plain pytest and ``--vram-report`` by test_third_party_parity.py."""

import itertools
import unittest

import torch

# The CPU only: under the simulated device CUDA is available too, and the subtests counted
# would not be plain pytest's.
DEVICES = ("cpu",)
DTYPES = (torch.float32, torch.float64)
TOLERANCES = {"euler": 2e-2, "midpoint": 2e-4, "rk4": 1e-6}


def odeint(func, y0, t, method):
    """Fixed-step integration of dy/dt = func(t, y) at the times ``t``."""
    ys = [y0]
    y = y0
    for t0, t1 in itertools.pairwise(t):
        dt = t1 - t0
        if method == "euler":
            y = y + dt * func(t0, y)
        elif method == "midpoint":
            y = y + dt * func(t0 + dt / 2, y + dt / 2 * func(t0, y))
        else:
            k1 = func(t0, y)
            k2 = func(t0 + dt / 2, y + dt / 2 * k1)
            k3 = func(t0 + dt / 2, y + dt / 2 * k2)
            k4 = func(t1, y + dt * k3)
            y = y + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        ys.append(y)
    return torch.stack(ys)


class TestSolvers(unittest.TestCase):
    def test_exponential_decay(self):
        for device in DEVICES:
            for dtype in DTYPES:
                for method, tolerance in TOLERANCES.items():
                    with self.subTest(device=device, dtype=dtype, method=method):
                        t = torch.linspace(0, 1, 51, device=device, dtype=dtype)
                        y0 = torch.tensor([1.0, 2.0], device=device, dtype=dtype)
                        ys = odeint(lambda t, y: -y, y0, t, method)
                        expected = y0 * torch.exp(-t)[:, None]
                        self.assertLess((ys - expected).abs().max().item(), tolerance)

    def test_shapes(self):
        for dtype in DTYPES:
            with self.subTest(dtype=dtype):
                t = torch.linspace(0, 1, 11, dtype=dtype)
                ys = odeint(lambda t, y: -y, torch.ones(3, 4, dtype=dtype), t, "rk4")
                self.assertEqual(ys.shape, (11, 3, 4))
                self.assertEqual(ys.dtype, dtype)


class TestGradients(unittest.TestCase):
    def test_backpropagates_through_the_solver(self):
        for method in TOLERANCES:
            with self.subTest(method=method):
                rate = torch.tensor(0.5, requires_grad=True)
                t = torch.linspace(0, 1, 21)
                ys = odeint(lambda t, y, rate=rate: -rate * y, torch.ones(2), t, method)
                ys[-1].sum().backward()
                self.assertTrue(torch.isfinite(rate.grad).all())
                self.assertLess(rate.grad.item(), 0.0)

    @unittest.expectedFailure
    def test_euler_is_not_exact(self):
        t = torch.linspace(0, 1, 11)
        ys = odeint(lambda t, y: -y, torch.ones(1), t, "euler")
        torch.testing.assert_close(ys[-1], torch.exp(-t[-1:]), rtol=0, atol=1e-7)
