"""Checkpoints (tests/ckpt and the tests that save and load): states of every kind, saves, damaged files."""

import torch
from torch import nn

from tests.helpers.dirs import fresh_dir


def model_and_optimizers(seed=0):
    """A small model of every kind of state (embedding, batch norm, bf16, bool, zero-size buffers), SGD and AdamW."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(300, 16), nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4))
    model.register_buffer("bf16", torch.randn(7, 5).to(torch.bfloat16))
    model.register_buffer("mask", torch.rand(9) > 0.5)
    model.register_buffer("nothing", torch.zeros(0, 3))  # zero-size: a dataset nobody writes
    sgd = torch.optim.SGD(list(model[0].parameters()) + list(model[1].parameters()), lr=0.1, momentum=0.9)
    adamw = torch.optim.AdamW(list(model[2].parameters()) + list(model[3].parameters()), lr=1e-3)
    return model, sgd, adamw


def train_steps(model, optimizers, steps, seed=1):
    """``steps`` optimizer steps of every optimizer on random embedding lookups."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 300, (24,), generator=gen)
        for opt in optimizers:
            opt.zero_grad()
        model(x).square().mean().backward()
        for opt in optimizers:
            opt.step()


def model_and_optimizer_state(model, optimizer):
    """The entries of ``model`` and ``optimizer`` (``hpcnet.ckpt.parts``), as a run with them saves them."""
    from hpcnet.ckpt.parts import ModelState, OptimizerState

    entries = ModelState(model).state_entries()
    entries.add(OptimizerState(optimizer).state_entries())
    return entries


def split_state(model, sgd, adamw):
    """Model state with both optimizers' state (AdamW's under ``adamw/``), and both metas."""
    entries, more = model_and_optimizer_state(model, sgd), model_and_optimizer_state(model, adamw)
    tensors = dict(entries.tensors)
    tensors.update({k.replace("optim/", "adamw/", 1): v for k, v in more.tensors.items() if k.startswith("optim/")})
    return tensors, {"sgd": entries.meta["state"], "adamw": more.meta["state"]}


def restore_split_state(model, sgd, adamw, tensors, meta):
    """Load what ``split_state`` returned back into ``model``, ``sgd`` and ``adamw``."""
    from hpcnet.ckpt.parts import ModelState, OptimizerState
    from hpcnet.stateful import Saved

    ModelState(model).load_entries(Saved(tensors, {}))
    OptimizerState(sgd).load_entries(Saved(tensors, {"state": meta["sgd"]}))
    adam = {k.replace("adamw/", "optim/", 1): v for k, v in tensors.items() if k.startswith("adamw/")}
    OptimizerState(adamw).load_entries(Saved(adam, {"state": meta["adamw"]}))


def assert_same_tensors(a, b):
    """Same names, dtypes, shapes and bits."""
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(-1).view(torch.uint8) if a[k].numel() else a[k],
                           b[k].view(-1).view(torch.uint8) if b[k].numel() else b[k]), k


def saved_run(comm, path, steps, *, shape, keep, full_every):
    """A fresh checkpoint directory at ``path`` with a one-tensor save at each of ``steps`` (synchronous,
    collective); the directory and the tensors, whose row 0 holds the step of the last save."""
    from hpcnet.ckpt.manager import CheckpointManager

    directory = fresh_dir(comm, path)
    tensors = {"model/w": torch.zeros(*shape)}
    with CheckpointManager(comm, directory, keep=keep, full_every=full_every, async_save=False) as manager:
        save_steps(manager, steps, tensors)
    return directory, tensors


def save_steps(manager, steps, tensors):
    """Save ``tensors`` at each of ``steps``, marking ``model/w[0]`` with the step."""
    for step in steps:
        tensors["model/w"][0] = step
        manager.save(step, tensors, {}, {"step": step})


def checkpoint_names(directory):
    """The ``ckpt-*`` file names in ``directory``, sorted."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("ckpt-"))


def flip_bytes_in(path, dataset):
    """Flip one byte inside ``dataset`` of the HDF5 file ``path``, below HDF5 (as bit rot would)."""
    import h5py

    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset()
    with open(path, "r+b") as handle:
        handle.seek(offset + 10)
        byte = handle.read(1)
        handle.seek(offset + 10)
        handle.write(bytes([byte[0] ^ 0xFF]))
