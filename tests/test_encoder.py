import numpy as np
import pytest
import torch
from torch import nn

from cleanrl_utils.encoder import NATURE_CNN_PARAMETERS, NatureCNN, check_encoder, count_parameters


def test_nature_cnn_has_the_published_size_and_output():
    encoder = NatureCNN()
    assert count_parameters(encoder) == NATURE_CNN_PARAMETERS == 1_684_128
    check_encoder(encoder)
    out = encoder(torch.zeros(2, 4, 84, 84, dtype=torch.uint8))
    assert out.shape == (2, 512)


def test_encoder_scales_uint8_input_by_1_over_255():
    encoder = NatureCNN()
    x = torch.randint(0, 256, (3, 4, 84, 84), dtype=torch.uint8)
    torch.testing.assert_close(encoder(x), encoder.net(x.float() / 255.0))


def wider() -> nn.Module:
    encoder = NatureCNN()
    encoder.net[7] = nn.Linear(3136, 1024)
    return encoder


def reshaped() -> nn.Module:
    # same parameter count, different shapes: first conv 4->32 8x8 replaced by 8x8 with a bias shift
    encoder = NatureCNN()
    encoder.net[0] = nn.Conv2d(4, 32, (16, 4), stride=4)
    return encoder


class Impostor(nn.Module):
    def __init__(self):
        super().__init__()
        self.weights = nn.Parameter(torch.zeros(NATURE_CNN_PARAMETERS))


@pytest.mark.parametrize(
    "make,message",
    [(wider, "parameters"), (reshaped, "shapes"), (Impostor, "not cleanrl_utils.NatureCNN")],
)
def test_encoder_check_rejects_any_other_shape_or_size(make, message):
    with pytest.raises(ValueError, match=message):
        check_encoder(make())


def test_the_layer_norm_variant_normalises_each_feature_map_and_has_its_own_checked_size():
    """PQN's declared variant: a LayerNorm (scale and shift per element) over each layer's whole output before its
    ReLU; the plain encoder keeps its layout, so its saved weights keep their names"""
    from cleanrl_utils.encoder import NATURE_CNN_LAYER_NORM_PARAMETERS

    encoder = NatureCNN(layer_norm=True)
    extra = 2 * (32 * 20 * 20 + 64 * 9 * 9 + 64 * 7 * 7 + 512)
    assert count_parameters(encoder) == NATURE_CNN_LAYER_NORM_PARAMETERS == NATURE_CNN_PARAMETERS + extra
    check_encoder(encoder, layer_norm=True)
    with pytest.raises(ValueError, match="layer_norm=True"):
        check_encoder(encoder, layer_norm=False)  # a caller expecting the plain encoder refuses the variant
    check_encoder(encoder)  # without an expectation: the variant it was built as, with its own count
    with pytest.raises(ValueError, match="layer_norm=False"):
        check_encoder(NatureCNN(), layer_norm=True)
    seen = []
    for layer in encoder.net:
        if isinstance(layer, nn.ReLU):
            layer.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0].detach()))
    out = encoder(torch.randint(0, 256, (3, 4, 84, 84), dtype=torch.uint8))
    assert out.shape == (3, 512) and [tuple(x.shape[1:]) for x in seen] == [
        (32, 20, 20),
        (64, 9, 9),
        (64, 7, 7),
        (512,),
    ]
    for before_relu in seen:  # LayerNorm's initial scale 1 and shift 0: each sample's map has mean 0, variance 1
        flat = before_relu.flatten(1).double()
        torch.testing.assert_close(flat.mean(1), torch.zeros(3, dtype=torch.float64), atol=1e-5, rtol=0)
        torch.testing.assert_close(flat.var(1, unbiased=False), torch.ones(3, dtype=torch.float64), atol=1e-3, rtol=0)
    assert [name for name, _ in NatureCNN().named_parameters()][::2] == [
        "net.0.weight",
        "net.2.weight",
        "net.4.weight",
        "net.7.weight",
    ]


def naive_same_conv(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, stride: int) -> np.ndarray:
    """float64 loops over output positions, padded as XLA's SAME (jax/_src/lax/lax.py, ``padtype_to_pads``, which
    Flax's ``nn.Conv`` takes by default): ceil(size / stride) outputs, the missing zeros split smaller half first"""
    n, c, size, _ = x.shape
    out_channels, _, kernel, _ = weight.shape
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    before = total // 2
    padded = np.zeros((n, c, size + total, size + total))
    padded[:, :, before : before + size, before : before + size] = x
    result = np.zeros((n, out_channels, out, out))
    for i in range(out):
        for j in range(out):
            window = padded[:, :, i * stride : i * stride + kernel, j * stride : j * stride + kernel]
            result[:, :, i, j] = np.einsum("nckl,ockl->no", window, weight) + bias
    return result


def test_the_same_padding_variant_is_dopamines_network_against_float64_loops():
    """Dopamine's encoder (dopamine/jax/networks.py, FullRainbowNetwork lines 573-590: three ``nn.Conv`` with Flax's
    default SAME padding, then ``nn.Dense(512)``): maps of 21, 11 and 11, 7,744 features, its own checked count; its
    output equals float64 loops padding each layer as XLA does, channel-major flattening (a fixed permutation of
    the dense layer's inputs against Flax's channel-last order, which changes no function the layer can hold)"""
    from cleanrl_utils.encoder import NATURE_CNN_SAME_PADDING_PARAMETERS

    encoder = NatureCNN(same_padding=True)
    convs = [m for m in encoder.net if isinstance(m, nn.Conv2d)]
    dense = [m for m in encoder.net if isinstance(m, nn.Linear)]
    assert count_parameters(encoder) == NATURE_CNN_SAME_PADDING_PARAMETERS == 4_043_424
    assert dense[0].in_features == 64 * 11 * 11
    check_encoder(encoder)
    with pytest.raises(ValueError, match="two variants"):
        NatureCNN(layer_norm=True, same_padding=True)
    obs = torch.randint(0, 256, (2, 4, 84, 84), dtype=torch.uint8)
    x = obs.double().numpy() / 255.0
    sizes = []
    for conv in convs:
        x = np.maximum(
            naive_same_conv(
                x, conv.weight.double().detach().numpy(), conv.bias.double().detach().numpy(), conv.stride[0]
            ),
            0,
        )
        sizes.append(x.shape[-1])
    assert sizes == [21, 11, 11]
    expected = np.maximum(
        x.reshape(2, -1) @ dense[0].weight.double().detach().numpy().T + dense[0].bias.double().detach().numpy(), 0
    )
    np.testing.assert_allclose(encoder(obs).double().detach().numpy(), expected, rtol=1e-4, atol=1e-5)
    # the plain encoder is unchanged: VALID convolutions, 3,136 features
    assert [m.in_features for m in NatureCNN().net if isinstance(m, nn.Linear)] == [3136]
