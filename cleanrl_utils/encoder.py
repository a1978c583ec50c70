"""The fixed Nature DQN encoder shared by every algorithm, and its capacity check."""

from __future__ import annotations

import torch
from torch import nn

NATURE_CNN_PARAMETERS = 1_684_128
NATURE_CNN_FEATURES = 512


class NatureCNN(nn.Module):
    """Mnih et al. (2015): three convolutions and a 512-unit layer over 4x84x84 uint8 frames."""

    def __init__(self, in_channels: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(in_channels, 32, 8, stride=4),
            nn.ReLU(),
            nn.Conv2d(32, 64, 4, stride=2),
            nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(3136, NATURE_CNN_FEATURES),
            nn.ReLU(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # uint8 frames travel and are stored as bytes; scaling happens here, on the device.
        return self.net(x.float() / 255.0)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def check_encoder(encoder: nn.Module) -> None:
    """Refuse an encoder that is not the Nature CNN, so algorithms compare on equal capacity."""
    if not isinstance(encoder, NatureCNN):
        raise ValueError(
            f"the encoder is a {type(encoder).__name__}, not cleanrl_utils.NatureCNN; "
            "every algorithm must use the shared Nature encoder so comparisons are fair"
        )
    count = count_parameters(encoder)
    if count != NATURE_CNN_PARAMETERS:
        raise ValueError(
            f"the encoder has {count:,} parameters, expected {NATURE_CNN_PARAMETERS:,} "
            "(Nature CNN: conv 4->32 8x8/4, 32->64 4x4/2, 64->64 3x3/1, linear 3136->512); "
            "do not change its shape, put algorithm-specific layers in the head"
        )
    shapes = [tuple(p.shape) for p in encoder.parameters()]
    expected = [
        (32, 4, 8, 8),
        (32,),
        (64, 32, 4, 4),
        (64,),
        (64, 64, 3, 3),
        (64,),
        (512, 3136),
        (512,),
    ]
    if shapes != expected:
        raise ValueError(f"the encoder's layer shapes {shapes} differ from the Nature CNN's {expected}")
