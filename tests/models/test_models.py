"""Tests for hpcnet.models: parameter counts, shapes, errors, determinism, learning."""

import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hpcnet.data.info import DatasetInfo
from hpcnet.errors import ConfigError
from hpcnet.models import MODELS, build_model, count_parameters

CIFAR = DatasetInfo("image", (3, 32, 32), 10)
MNIST = DatasetInfo("image", (1, 28, 28), 10)
TOKENS = DatasetInfo("tokens", (16,), 50)
SMALL_LM = {"d_model": 32, "n_layers": 2, "n_heads": 4}


# torchvision.models.resnetNN(): the standard ImageNet stem, 3x224x224, 1000 classes.
@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("resnet18", 11_689_512),
        ("resnet34", 21_797_672),
        ("resnet50", 25_557_032),
        ("resnet101", 44_549_160),
        ("resnet152", 60_192_808),
    ],
)
def test_resnet_parameter_counts_match_torchvision(name, expected):
    info = DatasetInfo("image", (3, 224, 224), 1000)
    # The meta device skips allocation and initialisation, so even resnet152 is instant.
    with torch.device("meta"):
        model = build_model(name, info)
    assert count_parameters(model) == expected


def test_small_input_changes_only_the_stem():
    info = DatasetInfo("image", (3, 224, 224), 1000)
    with torch.device("meta"):
        standard = build_model("resnet18", info)
        small = build_model("resnet18", info, {"small_input": True})
    assert isinstance(standard.maxpool, nn.MaxPool2d)
    assert isinstance(small.maxpool, nn.Identity)
    assert small.conv1.kernel_size == (3, 3)
    # 64 * 3 * (7*7 - 3*3) fewer stem weights.
    assert count_parameters(standard) - count_parameters(small) == 64 * 3 * 40


@pytest.mark.parametrize("info", [CIFAR, MNIST], ids=["3x32x32", "1x28x28"])
def test_resnet_tiny_forward_shape(info):
    torch.manual_seed(0)
    model = build_model("resnet_tiny", info)
    # Auto small_input for inputs <= 64 pixels: no max-pool stem.
    assert isinstance(model.maxpool, nn.Identity)
    assert model.conv1.in_channels == info.input_shape[0]
    out = model(torch.randn(2, *info.input_shape))
    assert out.shape == (2, info.num_classes)


def test_zero_init_residual_zeroes_last_bn():
    torch.manual_seed(0)
    model = build_model("resnet_tiny", CIFAR, {"zero_init_residual": True})
    assert torch.all(model.layer1[0].bn2.weight == 0)
    assert torch.all(model.layer1[0].bn1.weight == 1)


def test_mlp_forward_shape_and_options():
    torch.manual_seed(0)
    model = build_model("mlp", MNIST, {"hidden": [64, 32], "activation": "gelu", "dropout": 0.1})
    linears = [m for m in model if isinstance(m, nn.Linear)]
    assert [m.out_features for m in linears] == [64, 32, 10]
    assert linears[0].in_features == 28 * 28
    assert model(torch.randn(3, 1, 28, 28)).shape == (3, 10)


def test_transformer_forward_shape_and_tied_weights():
    torch.manual_seed(0)
    model = build_model("transformer", TOKENS, SMALL_LM)
    tokens = torch.randint(0, 50, (2, 16))
    assert model(tokens).shape == (2, 16, 50)
    assert model.head.weight is model.token_embedding.weight
    untied = build_model("transformer", TOKENS, {**SMALL_LM, "tie_weights": False})
    assert count_parameters(untied) - count_parameters(model) == 50 * 32


def test_transformer_is_causal():
    torch.manual_seed(0)
    model = build_model("transformer", TOKENS, SMALL_LM).eval()
    tokens = torch.randint(0, 50, (1, 16))
    changed = tokens.clone()
    changed[0, 10] = (tokens[0, 10] + 1) % 50
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_unknown_model_name_suggests_closest():
    with pytest.raises(ConfigError, match=r"model\.name: unknown model 'resnet19'.*'resnet18'.*mlp"):
        build_model("resnet19", CIFAR)


def test_unknown_option_is_named():
    with pytest.raises(ConfigError, match=r"model\.options: .*'widht'.*'width'"):
        build_model("resnet_tiny", CIFAR, {"widht": 8})


@pytest.mark.parametrize(
    ("name", "options", "option"),
    [
        ("mlp", {"activation": "swish"}, "model.options.activation"),
        ("mlp", {"dropout": 1.5}, "model.options.dropout"),
        ("resnet_tiny", {"width": 0}, "model.options.width"),
        ("transformer", {"d_model": 30, "n_heads": 4}, "model.options.n_heads"),
    ],
)
def test_bad_option_value_is_named(name, options, option):
    info = TOKENS if name == "transformer" else CIFAR
    with pytest.raises(ConfigError, match=option.replace(".", r"\.")):
        build_model(name, info, options)


@pytest.mark.parametrize(("name", "info"), [("transformer", CIFAR), ("mlp", TOKENS), ("resnet18", TOKENS)])
def test_kind_mismatch(name, info):
    with pytest.raises(ConfigError, match=rf"model\.name: .*'{name}'.*'{info.kind}'"):
        build_model(name, info)


def test_every_registered_model_builds():
    for name in MODELS:
        info = TOKENS if name == "transformer" else CIFAR
        with torch.device("meta"):
            assert isinstance(build_model(name, info), nn.Module)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(
        textwrap.dedent(
            """
            import torch.nn as nn

            def linear(info, bias=True):
                return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, info.num_classes, bias=bias))

            def not_a_model(info):
                return 42
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_models"


def test_user_factory_by_import_path(user_module):
    model = build_model("ignored", CIFAR, {"bias": False}, factory=f"{user_module}:linear")
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert count_parameters(model) == 3 * 32 * 32 * 10


def test_user_factory_errors(user_module):
    with pytest.raises(ConfigError, match=r"model\.factory: .*not a torch\.nn\.Module"):
        build_model("x", CIFAR, factory=f"{user_module}:not_a_model")
    with pytest.raises(ConfigError, match=r"model\.options: .*'depth'"):
        build_model("x", CIFAR, {"depth": 3}, factory=f"{user_module}:linear")
    with pytest.raises(ConfigError, match=r"model\.factory"):
        build_model("x", CIFAR, factory=f"{user_module}:missing")


@pytest.mark.parametrize(("name", "info"), [("resnet_tiny", CIFAR), ("mlp", MNIST), ("transformer", TOKENS)])
def test_same_seed_same_parameters(name, info):
    options = SMALL_LM if name == "transformer" else {}
    states = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        states.append(build_model(name, info, options).state_dict())
    for key in states[0]:
        torch.testing.assert_close(states[0][key], states[1][key], rtol=0, atol=0)
    assert any(not torch.equal(states[0][k], states[2][k]) for k in states[0] if states[0][k].is_floating_point())


@pytest.mark.parametrize(
    ("name", "info", "options"),
    [
        ("mlp", MNIST, {"hidden": [64]}),
        ("resnet_tiny", CIFAR, {"width": 8}),
        ("transformer", TOKENS, SMALL_LM),
    ],
)
def test_sgd_steps_reduce_loss(name, info, options):
    torch.manual_seed(0)
    model = build_model(name, info, options)
    if info.kind == "image":
        inputs = torch.randn(8, *info.input_shape)
        targets = torch.randint(0, info.num_classes, (8,))
    else:
        inputs = torch.randint(0, info.num_classes, (4, *info.input_shape))
        targets = torch.roll(inputs, -1, dims=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def loss_fn() -> torch.Tensor:
        logits = model(inputs)
        return F.cross_entropy(logits.reshape(-1, info.num_classes), targets.reshape(-1))

    first = loss_fn()
    for _ in range(10):
        optimizer.zero_grad()
        loss = loss_fn()
        loss.backward()
        optimizer.step()
    assert loss_fn().item() < first.item()
