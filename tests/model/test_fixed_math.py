""":mod:`model.fixed_math`: close to torch's transcendentals, and an element's bits depend on its value alone — the
same alone, inside a tensor of any length (vector body or scalar tail), and under every CPU code path
(``tests/e2e/test_cpu_code_paths.py`` reruns this module under other instruction sets)."""

import math

import pytest
import torch

from model import fixed_math


def values(n: int = 4099, scale: float = 30.0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(1)) * scale


def test_exp_is_within_2_ulp_and_handles_the_edges():
    x = torch.linspace(-87.3, 88.0, 200_001)
    want = torch.exp(x.double())
    rel = ((fixed_math.exp(x).double() - want).abs() / want).max().item()
    assert rel < 2 * 2.0**-24, rel
    edges = fixed_math.exp(torch.tensor([-math.inf, -100.0, 0.0, 100.0, math.inf, math.nan]))
    assert edges[:3].tolist() == [0.0, 0.0, 1.0] and edges[3] == edges[4] == fixed_math.exp(torch.tensor(88.0))
    assert math.isnan(edges[5].item())


def test_log_is_within_2_ulp_on_its_domain():
    u = torch.logspace(-7.2, 7.2, 200_001)  # the sampler's logs see [2**-24, 17]
    want = torch.log(u.double())
    err = ((fixed_math.log(u).double() - want).abs() / (want.abs() * 2.0**-24).clamp_min(2.0**-149)).max().item()
    assert err < 2.0, err


@pytest.mark.parametrize("fn", [fixed_math.exp, fixed_math.sigmoid, lambda t: fixed_math.log(t.abs() + 1e-3)],
                         ids=["exp", "sigmoid", "log"])
def test_an_element_is_the_same_alone_and_anywhere_in_a_tensor(fn):
    x = values()
    full = fn(x)
    for n in (1, 3, 17, 31, 33, 4099):
        part = fn(x[:n])
        assert torch.equal(part, full[:n]), n
    assert all(torch.equal(fn(x[j:j + 1]), full[j:j + 1]) for j in range(0, 4099, 7))


def test_sigmoid_is_close_to_torchs():
    x = values()
    torch.testing.assert_close(fixed_math.sigmoid(x), torch.sigmoid(x), rtol=0, atol=2e-7)
