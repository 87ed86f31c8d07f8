"""model.blocks and train.activation_checkpointing: which modules are blocks, and recomputing them changes no bit."""

import copy

import pytest
import torch
from torch import nn

from hpcnet.data.info import DatasetInfo
from hpcnet.errors import ConfigError
from hpcnet.models import build_model
from hpcnet.models.blocks import checkpoint_blocks, find_blocks
from hpcnet.train import run
from tests.helpers.data import tiny_images
from tests.helpers.train import train_config

IMAGES = DatasetInfo("image", (3, 32, 32), 10)
TOKENS = DatasetInfo("tokens", (64,), 256)


@pytest.mark.parametrize("name, info, options, expected", [
    ("transformer", TOKENS, {"n_layers": 3}, ["blocks.0", "blocks.1", "blocks.2"]),
    # A large vocabulary: the output layer tied to the embedding holds more than the layers; still the layers.
    ("transformer", DatasetInfo("tokens", (16,), 8192), {"d_model": 64, "n_layers": 2, "n_heads": 2},
     ["blocks.0", "blocks.1"]),
    ("resnet_tiny", IMAGES, {}, ["layer1.0", "layer2.0", "layer3.0", "layer4.0"]),  # not their convolutions
    ("resnet18", IMAGES, {}, [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]),
    ("mlp", IMAGES, {"hidden": [64, 64]}, ["1", "3", "5"]),
])
def test_auto_finds_the_repeated_modules_that_hold_the_parameters(name, info, options, expected):
    model = build_model(name, info, options)
    assert [n for n, _ in find_blocks(model)] == expected


def test_blocks_by_class_or_path_and_clear_errors():
    model = build_model("transformer", TOKENS, {"n_layers": 3})
    assert [n for n, _ in find_blocks(model, "hpcnet.models.transformer.TransformerBlock")] == \
        ["blocks.0", "blocks.1", "blocks.2"]
    assert [n for n, _ in find_blocks(model, "blocks.2, blocks.0")] == ["blocks.0", "blocks.2"]  # model order
    for spec, needle in [("blocks.7", "model.blocks: the model has no module 'blocks.7' (it has blocks, blocks.0"),
                         ("nopkg.Block", "model.blocks: cannot import 'nopkg.Block'"),
                         ("math.pi", "'math.pi' is not an nn.Module class"),
                         ("torch.nn.Conv3d", "the model has no torch.nn.Conv3d module"),
                         (" , ", "model.blocks is empty")]:
        with pytest.raises(ConfigError, match=None) as info:
            find_blocks(model, spec)
        assert needle in str(info.value), str(info.value)


class _Block(nn.Module):
    """Dropout and batch norm: what a recomputation must replay and leave alone."""

    def __init__(self):
        super().__init__()
        self.lin, self.norm, self.drop = nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.3)

    def forward(self, x):
        return self.drop(torch.relu(self.norm(self.lin(x)))) + x


def test_a_checkpointed_block_gives_the_same_bits_and_batch_norm_statistics():
    torch.manual_seed(0)
    plain = nn.Sequential(_Block(), _Block(), nn.Linear(16, 2))
    recomputed = copy.deepcopy(plain)
    blocks = find_blocks(recomputed)
    assert [n for n, _ in blocks] == ["0", "1"]
    checkpoint_blocks(blocks)
    checkpoint_blocks(blocks)  # idempotent
    x = torch.randn(8, 16)
    for model in (plain, recomputed):
        torch.manual_seed(1)
        for _ in range(2):
            model(x).square().sum().backward()
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters()):
        assert torch.equal(a.grad, b.grad), name
    for (name, a), b in zip(plain.named_buffers(), recomputed.buffers()):
        assert torch.equal(a, b), name  # the recomputation did not count its batch twice
    assert list(plain.state_dict()) == list(recomputed.state_dict())  # no wrapper in the names
    recomputed.eval()
    plain.eval()
    with torch.no_grad():
        assert torch.equal(plain(x), recomputed(x))


def test_checkpointed_blocks_keep_only_their_inputs_until_backward():
    """What the forward leaves alive for backward (every tensor torch allocates, counted until freed): with the
    blocks checkpointed, about one block input each instead of all their activations."""
    from hpcnet.plan.measure import _LiveBytes

    torch.manual_seed(0)
    model = build_model("transformer", TOKENS, {"d_model": 64, "n_layers": 4, "n_heads": 2})
    tokens = torch.randint(0, 256, (8, 64))
    kept = {}
    for mode in ("off", "blocks"):
        if mode == "blocks":
            checkpoint_blocks(find_blocks(model))
        with _LiveBytes() as live:
            out = model(tokens)
        kept[mode] = live.live
        out.sum().backward()
        del out
    block_input = 8 * 64 * 64 * 4
    assert kept["off"] - kept["blocks"] > 4 * 8 * block_input, kept  # the blocks' activations, gone
    assert kept["blocks"] < kept["off"] / 2, kept


def _dataset(comm, tmp):
    return tiny_images(comm, tmp, "blocks-images.h5", num_train=128, num_eval=16, seed=9)


@pytest.mark.mpi
@pytest.mark.parametrize("extra", [
    ["dist.zero=0"],
    ["dist.zero=2", "dist.owners=uniform", "optim.name=adamw", "optim.lr=0.003"],
    ["dist.zero=1", "dist.owners=uniform", "train.grad_accumulation=2", "train.precision=bf16"],
])
def test_training_with_activation_checkpointing_gives_the_bits_of_training_without(comm, data_plane, mpi_tmp_path,
                                                                                    extra):
    """resnet_tiny (batch norm in every block), each rank on its own data, at every stage: the same parameters,
    batch-norm statistics and loss after 4 steps as without checkpointing (the owners by bytes alone, so that both
    runs have the same ones: measured speeds could give them others, summed in another order)."""
    dataset = _dataset(comm, mpi_tmp_path)
    name = "-".join(x.split("=")[1] for x in extra[:2])
    results = [run(train_config(mpi_tmp_path, dataset, f"ac-{mode}-{name}", "train.steps=4", "model.name=resnet_tiny",
                                "checkpoint.at_end=false", f"train.activation_checkpointing={mode}", *extra),
                   comm, plane=data_plane)
               for mode in ("off", "blocks")]
    plain, recomputed = (r.model.state_dict() for r in results)
    assert list(plain) == list(recomputed)
    for key in plain:
        assert torch.equal(plain[key], recomputed[key]), key
    assert results[0].summary["final_loss"] == results[1].summary["final_loss"]
    comm.Barrier()
