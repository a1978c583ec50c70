"""The fixed Nature DQN encoder shared by every algorithm, and its capacity check. Its two declared variants:
``NatureCNN(layer_norm=True)``, PQN's (Gallici et al. 2024; CleanRL's pqn_atari_envpool.py): LayerNorm over each
feature map before each ReLU, 43,264 parameters more; ``NatureCNN(same_padding=True)``, Dopamine's (its JAX
networks' Flax convolutions pad SAME): the same layers over zero-padded maps, 21x21, 11x11 and 11x11, so 7,744
features reach the 512-unit layer, 2,359,296 parameters more (DrQ(eps)'s reference agent)."""

from __future__ import annotations

import torch
from torch import nn

NATURE_CNN_PARAMETERS = 1_684_128
NATURE_CNN_LAYER_NORM_PARAMETERS = 1_727_392  # + LayerNorm scales and shifts over (32, 20, 20), (64, 9, 9), ...
NATURE_CNN_SAME_PADDING_PARAMETERS = 4_043_424  # the 512-unit layer takes 64 x 11 x 11 = 7,744 features, not 3,136
NATURE_CNN_FEATURES = 512
# (out channels, kernel, stride) of the three convolutions
NATURE_CNN_CONVOLUTIONS = ((32, 8, 4), (64, 4, 2), (64, 3, 1))


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """XLA's (so Flax's default) SAME padding of one axis: the output has ceil(size / stride) positions, and the
    zeros it needs are split with the smaller half before the image (84, 8, 4: (2, 2); 21, 4, 2: (1, 2))"""
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


class NatureCNN(nn.Module):
    """Mnih et al. (2015): three convolutions and a 512-unit layer over 4x84x84 uint8 frames; ``layer_norm``:
    each layer's output normalised (LayerNorm over the whole feature map) before its ReLU, as PQN does."""

    def __init__(self, in_channels: int = 4, layer_norm: bool = False, same_padding: bool = False) -> None:
        super().__init__()
        if layer_norm and same_padding:
            raise ValueError("NatureCNN: layer_norm (PQN's variant) and same_padding (Dopamine's) are two variants")
        self.layer_norm = layer_norm
        self.same_padding = same_padding
        if same_padding:
            self.net = same_padding_layers(in_channels)
            return

        def block(layer: nn.Module, *shape: int) -> list[nn.Module]:
            return [layer, nn.LayerNorm(list(shape)), nn.ReLU()] if layer_norm else [layer, nn.ReLU()]

        self.net = nn.Sequential(
            *block(nn.Conv2d(in_channels, 32, 8, stride=4), 32, 20, 20),
            *block(nn.Conv2d(32, 64, 4, stride=2), 64, 9, 9),
            *block(nn.Conv2d(64, 64, 3, stride=1), 64, 7, 7),
            nn.Flatten(),
            *block(nn.Linear(3136, NATURE_CNN_FEATURES), NATURE_CNN_FEATURES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # uint8 frames travel and are stored as bytes; scaling happens here, on the device.
        return self.net(x.float() / 255.0)


def same_padding_layers(in_channels: int, size: int = 84) -> nn.Sequential:
    """The Nature CNN's layers with SAME padding (symmetric zeros as the convolution's own padding, asymmetric ones
    as a ZeroPad2d before it)"""
    layers: list[nn.Module] = []
    for out_channels, kernel, stride in NATURE_CNN_CONVOLUTIONS:
        before, after = same_padding(size, kernel, stride)
        if before != after:
            layers.append(nn.ZeroPad2d((before, after, before, after)))
        layers += [nn.Conv2d(in_channels, out_channels, kernel, stride, padding=before if before == after else 0)]
        layers.append(nn.ReLU())
        in_channels, size = out_channels, -(-size // stride)
    features = in_channels * size * size
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(features, NATURE_CNN_FEATURES), nn.ReLU())


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def check_encoder(encoder: nn.Module, layer_norm: bool | None = None) -> None:
    """Refuse an encoder that is not the Nature CNN or a declared variant of it (``layer_norm``: the variant the
    caller expects; None: the one the encoder was built as; ``same_padding``: as it was built), with its own
    parameter count, so algorithms compare on equal capacity."""
    if not isinstance(encoder, NatureCNN):
        raise ValueError(
            f"the encoder is a {type(encoder).__name__}, not cleanrl_utils.NatureCNN; "
            "every algorithm must use the shared Nature encoder so comparisons are fair"
        )
    layer_norm = encoder.layer_norm if layer_norm is None else layer_norm
    if encoder.layer_norm != layer_norm:
        raise ValueError(
            f"the encoder has layer_norm={encoder.layer_norm}, the script declares layer_norm={layer_norm}: "
            "LayerNorm is PQN's declared variant only"
        )
    if encoder.same_padding:
        expected_count = NATURE_CNN_SAME_PADDING_PARAMETERS
    else:
        expected_count = NATURE_CNN_LAYER_NORM_PARAMETERS if layer_norm else NATURE_CNN_PARAMETERS
    count = count_parameters(encoder)
    if count != expected_count:
        raise ValueError(
            f"the encoder has {count:,} parameters, expected {expected_count:,} "
            "(Nature CNN: conv 4->32 8x8/4, 32->64 4x4/2, 64->64 3x3/1, linear 3136->512, or 7744->512 with SAME "
            "padding); "
            "do not change its shape, put algorithm-specific layers in the head"
        )
    shapes = [tuple(p.shape) for p in encoder.parameters()]
    flat = 7744 if encoder.same_padding else 3136
    expected = [(32, 4, 8, 8), (32,), (64, 32, 4, 4), (64,), (64, 64, 3, 3), (64,), (512, flat), (512,)]
    if layer_norm:  # each layer's weight and bias, then its LayerNorm's scale and shift
        norms = [(32, 20, 20), (64, 9, 9), (64, 7, 7), (512,)]
        expected = [shape for i, n in enumerate(norms) for shape in (*expected[2 * i : 2 * i + 2], n, n)]
    if shapes != expected:
        raise ValueError(f"the encoder's layer shapes {shapes} differ from the Nature CNN's {expected}")
