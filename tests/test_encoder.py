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
