"""NoisyLinear (algos/rainbow.py): factorised Gaussian noise of the right shapes and law, the forward pass
against a naive float64 loop, noise fixed between draws and new after reset_noise(), evaluation mode on the mean
weights, the paper's initialisation, gradients to mu and sigma. No mocks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import REPO
from torch import nn

from cleanrl_utils.tools.evaluate import load_algorithm

rainbow = load_algorithm(REPO / "algos" / "rainbow.py")  # the layer lives in the script that uses it
NoisyLinear, mean_sigma, reset_noise = rainbow.NoisyLinear, rainbow.mean_sigma, rainbow.reset_noise


def naive_forward(layer: NoisyLinear, x: torch.Tensor, noisy: bool) -> list[list[float]]:
    """float64 loops: y_k = sum_i (mu_ki + sigma_ki * f(e_out)_k * f(e_in)_i) x_i + mu_b_k + sigma_b_k * f(e_out)_k"""
    mu, sigma = layer.weight_mu.double().tolist(), layer.weight_sigma.double().tolist()
    b_mu, b_sigma = layer.bias_mu.double().tolist(), layer.bias_sigma.double().tolist()
    e_in, e_out = layer.epsilon_in.double().tolist(), layer.epsilon_out.double().tolist()
    out = []
    for row in x.double().tolist():
        y = []
        for k in range(layer.out_features):
            total = b_mu[k] + (b_sigma[k] * e_out[k] if noisy else 0.0)
            for i in range(layer.in_features):
                w = mu[k][i] + (sigma[k][i] * e_out[k] * e_in[i] if noisy else 0.0)
                total += w * row[i]
            y.append(total)
        out.append(y)
    return out


def test_noise_shapes_and_factorisation():
    torch.manual_seed(0)
    layer = NoisyLinear(7, 3)
    assert layer.weight_mu.shape == layer.weight_sigma.shape == (3, 7)
    assert layer.bias_mu.shape == layer.bias_sigma.shape == (3,)
    assert layer.epsilon_in.shape == (7,) and layer.epsilon_out.shape == (3,)
    torch.manual_seed(5)
    layer.reset_noise()
    torch.manual_seed(5)  # the same draws by hand: f(x) = sgn(x) sqrt(|x|) of standard normals, inputs first
    x_in, x_out = torch.randn(7), torch.randn(3)
    torch.testing.assert_close(layer.epsilon_in, x_in.sign() * x_in.abs().sqrt())
    torch.testing.assert_close(layer.epsilon_out, x_out.sign() * x_out.abs().sqrt())
    eps_w = layer.weight_epsilon()
    assert eps_w.shape == (3, 7)
    assert torch.linalg.matrix_rank(eps_w) == 1  # factorised: an outer product of p + q draws
    torch.testing.assert_close(eps_w, torch.outer(layer.epsilon_out, layer.epsilon_in))
    # the noise is not learned: not a parameter, not in the state dict
    assert {name for name, _ in layer.named_parameters()} == {"weight_mu", "weight_sigma", "bias_mu", "bias_sigma"}
    assert set(layer.state_dict()) == {"weight_mu", "weight_sigma", "bias_mu", "bias_sigma"}


def test_noise_law():
    """eps_w_ij = f(x) f(y) with x, y standard normal: mean 0, variance E|x| E|y| = 2 / pi"""
    torch.manual_seed(1)
    layer = NoisyLinear(4, 3)
    draws = []
    for _ in range(4000):
        layer.reset_noise()
        draws.append(layer.weight_epsilon().flatten())
    draws = torch.stack(draws)  # (4000, 12)
    assert draws.mean().abs() < 0.03
    assert draws.var().item() == pytest.approx(2 / math.pi, rel=0.05)


def test_forward_matches_naive_loops_in_training_and_evaluation():
    torch.manual_seed(2)
    layer = NoisyLinear(6, 4, sigma_0=0.8)
    x = torch.randn(5, 6)
    layer.train()
    noisy = layer(x)
    np.testing.assert_allclose(noisy.double().detach().numpy(), naive_forward(layer, x, True), rtol=1e-5, atol=1e-6)
    layer.eval()
    mean = layer(x)
    np.testing.assert_allclose(mean.double().detach().numpy(), naive_forward(layer, x, False), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mean, nn.functional.linear(x, layer.weight_mu, layer.bias_mu))
    assert not torch.allclose(noisy, mean, atol=1e-3)  # the noise does change the training output


def test_noise_is_fixed_between_draws_and_evaluation_ignores_it():
    torch.manual_seed(3)
    layer = NoisyLinear(8, 5)
    x = torch.randn(3, 8)
    first, again = layer(x), layer(x)
    torch.testing.assert_close(first, again)  # same noise until reset_noise()
    layer.reset_noise()
    second = layer(x)
    assert not torch.allclose(first, second, atol=1e-4)  # a new draw
    layer.eval()
    evaluations = []
    for _ in range(3):
        layer.reset_noise()
        evaluations.append(layer(x))
    torch.testing.assert_close(evaluations[0], evaluations[1])
    torch.testing.assert_close(evaluations[0], evaluations[2])


def test_sigma_zero_is_a_plain_linear_layer():
    torch.manual_seed(4)
    layer = NoisyLinear(5, 2, sigma_0=0.0)
    x = torch.randn(4, 5)
    torch.testing.assert_close(layer.train()(x), layer.eval()(x))


def test_initialisation_as_the_paper():
    torch.manual_seed(6)
    p = 64
    layer = NoisyLinear(p, 32, sigma_0=0.5)
    bound = 1 / math.sqrt(p)
    assert layer.weight_mu.abs().max() <= bound and layer.bias_mu.abs().max() <= bound
    assert layer.weight_mu.std().item() == pytest.approx(2 * bound / math.sqrt(12), rel=0.1)  # uniform's std
    torch.testing.assert_close(layer.weight_sigma, torch.full((32, p), 0.5 / math.sqrt(p)))
    torch.testing.assert_close(layer.bias_sigma, torch.full((32,), 0.5 / math.sqrt(p)))
    assert mean_sigma(nn.Sequential(layer, nn.ReLU())) == pytest.approx(0.5 / math.sqrt(p))


def test_gradients_reach_mu_and_sigma_and_reset_noise_reaches_every_layer():
    torch.manual_seed(7)
    net = nn.Sequential(NoisyLinear(4, 6), nn.ReLU(), NoisyLinear(6, 2))
    net(torch.randn(8, 4)).pow(2).sum().backward()
    for name, parameter in net.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
    before = [layer.epsilon_in.clone() for layer in (net[0], net[2])]
    reset_noise(net)
    assert all(not torch.equal(b, layer.epsilon_in) for b, layer in zip(before, (net[0], net[2]), strict=True))


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="positive sizes"):
        NoisyLinear(0, 3)
    with pytest.raises(ValueError, match="sigma_0"):
        NoisyLinear(3, 3, sigma_0=-0.1)
