"""A linear layer with learned, factorised Gaussian noise on its weights (Fortunato et al. 2018, NoisyNet).

``y = (mu_w + sigma_w * eps_w) x + mu_b + sigma_b * eps_b`` with factorised noise: ``eps_w = f(eps_out)
f(eps_in)^T`` and ``eps_b = f(eps_out)``, ``f(x) = sgn(x) sqrt(|x|)``, ``eps_in`` and ``eps_out`` standard
normal vectors of the layer's input and output sizes (p + q draws instead of p * q). Initialisation as the
paper's section 3.2: ``mu ~ U[-1/sqrt(p), 1/sqrt(p)]``, ``sigma = sigma_0 / sqrt(p)`` with p the input size.

The noise stays fixed between calls of ``reset_noise()``; in evaluation mode (``.eval()``) the layer uses
its mean weights ``mu_w``, ``mu_b`` only. The noise is not part of the state dict (it is not learned).
"""

from __future__ import annotations

import math

import torch
from torch import nn


def scaled_noise(size: int, device: torch.device) -> torch.Tensor:
    """f(x) = sgn(x) sqrt(|x|) of ``size`` standard normal draws"""
    x = torch.randn(size, device=device)
    return x.sign() * x.abs().sqrt()


class NoisyLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, sigma_0: float = 0.5) -> None:
        super().__init__()
        if in_features < 1 or out_features < 1:
            raise ValueError(f"NoisyLinear needs positive sizes, got {in_features} -> {out_features}")
        if not sigma_0 >= 0:
            raise ValueError(f"sigma_0 {sigma_0} must be >= 0 (0: no noise)")
        self.in_features, self.out_features, self.sigma_0 = in_features, out_features, sigma_0
        self.weight_mu = nn.Parameter(torch.empty(out_features, in_features))
        self.weight_sigma = nn.Parameter(torch.empty(out_features, in_features))
        self.bias_mu = nn.Parameter(torch.empty(out_features))
        self.bias_sigma = nn.Parameter(torch.empty(out_features))
        self.register_buffer("epsilon_in", torch.zeros(in_features), persistent=False)
        self.register_buffer("epsilon_out", torch.zeros(out_features), persistent=False)
        self.reset_parameters()
        self.reset_noise()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.in_features)
        with torch.no_grad():
            self.weight_mu.uniform_(-bound, bound)
            self.bias_mu.uniform_(-bound, bound)
            self.weight_sigma.fill_(self.sigma_0 / math.sqrt(self.in_features))
            self.bias_sigma.fill_(self.sigma_0 / math.sqrt(self.in_features))

    def reset_noise(self) -> None:
        """a new draw of eps_in and eps_out, used by every forward pass in training mode until the next"""
        self.epsilon_in.copy_(scaled_noise(self.in_features, self.epsilon_in.device))
        self.epsilon_out.copy_(scaled_noise(self.out_features, self.epsilon_out.device))

    def weight_epsilon(self) -> torch.Tensor:
        """eps_w = f(eps_out) f(eps_in)^T, (out_features, in_features)"""
        return torch.outer(self.epsilon_out, self.epsilon_in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:  # evaluation: the mean weights
            return nn.functional.linear(x, self.weight_mu, self.bias_mu)
        weight = self.weight_mu + self.weight_sigma * self.weight_epsilon()
        bias = self.bias_mu + self.bias_sigma * self.epsilon_out
        return nn.functional.linear(x, weight, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, sigma_0={self.sigma_0}"


def reset_noise(module: nn.Module) -> None:
    """a new noise draw for every NoisyLinear inside ``module``"""
    for layer in module.modules():
        if isinstance(layer, NoisyLinear):
            layer.reset_noise()


def mean_sigma(module: nn.Module) -> float:
    """the mean |sigma| over the weights of every NoisyLinear inside ``module`` (how much noise is left)"""
    sigmas = [
        layer.weight_sigma.detach().abs().flatten() for layer in module.modules() if isinstance(layer, NoisyLinear)
    ]
    return torch.cat(sigmas).mean().item() if sigmas else 0.0
