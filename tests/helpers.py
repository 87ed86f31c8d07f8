"""Helpers shared by the tests (fixtures are in ``conftest.py``): one copy of each, imported as ``tests.helpers``."""

import ipaddress
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = Path(__file__).resolve().parent / "programs"
"""Programs that tests launch under mpirun."""


def train_config(tmp: Path, dataset: Path, name: str, *extra: str):
    """A small test run's Config: its own run and checkpoint directories under ``tmp``, batch 4, no
    evaluation, no probe; ``extra`` overrides (``train.steps=20``) decide the rest."""
    from hpcnet.config.load import load_config

    return load_config(overrides=[
        f"data.dataset={dataset}", f"run.dir={tmp / 'runs' / name}", "run.dir_exact=true",
        f"checkpoint.dir={tmp / 'ckpt' / name}", "train.batch_size=4", "train.eval_every=0", "dist.probe=false",
        *extra])


class StopAfter:
    """Stands in for the signal handler: asks to stop (SIGUSR2) after ``steps`` steps."""

    def __init__(self, steps):
        self.calls, self.steps = 0, steps

    @property
    def signum(self):
        self.calls += 1
        return signal.SIGUSR2 if self.calls >= self.steps else 0


def tiny_images(comm, directory: Path, name: str, *, num_train: int, num_eval: int, seed: int) -> Path:
    """A small 4-class 1x8x8 image set shared by the ranks of ``comm``: rank 0 writes it once (collective)."""
    from hpcnet.data.synthetic import generate_images

    path = directory / name
    if comm.Get_rank() == 0 and not path.exists():
        generate_images(path, num_train=num_train, num_eval=num_eval, shape=(1, 8, 8), num_classes=4, seed=seed)
    comm.Barrier()
    return path


def nodes_of(local_sizes: list[int]) -> list[list[int]]:
    """Consecutive global ranks grouped into nodes of the given sizes: ``[2, 1]`` -> ``[[0, 1], [2]]``."""
    ranks = iter(range(sum(local_sizes)))
    return [[next(ranks) for _ in range(n)] for n in local_sizes]


def fake_net(root, name, *, operstate="up", link_type="1", speed=None, rdma_device=False):
    """Add interface ``name`` to a fake /sys/class/net tree at ``root`` (``hpcnet.comm.netif`` reads it)."""
    base = root / name
    base.mkdir(parents=True)
    (base / "operstate").write_text(operstate + "\n")
    (base / "type").write_text(link_type + "\n")
    if speed is not None:
        (base / "speed").write_text(f"{speed}\n")
    if rdma_device:
        (base / "device" / "infiniband" / "mlx5_0").mkdir(parents=True)
    return base


def clean_env(**extra):
    """The environment for a child mpirun: none of this process's MPI wiring."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_btl_base_warn_component_unused="0",
               PYTHONPATH=str(ROOT))
    env.update(extra)
    return env


def write_dataset(path: Path, *, kind: str = "image", n: int = 8, attrs=None, drop=(), **arrays) -> Path:
    """A small valid hpcnet dataset file, with overrides to break it (``train_targets=...``, ``drop=("train",)``)."""
    import h5py
    import numpy as np

    if kind == "image":
        x = np.zeros((n, 1, 2, 2), np.float32)
        y = np.arange(n) % 3
    else:
        x = np.arange(n * 4).reshape(n, 4) % 5
        y = (x + 1) % 5
    with h5py.File(path, "w") as f:
        f.attrs.update({"hpcnet_format": 1, "kind": kind, "num_classes": 3 if kind == "image" else 5,
                        **(attrs or {})})
        for split in ("train", "eval"):
            for name, value in (("inputs", x), ("targets", y)):
                key = f"{split}/{name}"
                if key not in drop:
                    f.create_dataset(key, data=arrays.get(f"{split}_{name}", value))
        for name in drop:
            if name in f:
                del f[name]
    return path


def load_split(path: Path, split: str):
    """All of ``/<split>/inputs`` and ``/<split>/targets`` of a dataset file, as numpy arrays."""
    import h5py

    with h5py.File(path, "r") as f:
        return f[split]["inputs"][()], f[split]["targets"][()]


def listening_sockets(pid: str = "self") -> dict[str, tuple[str, int]]:
    """This process's listening TCP sockets: inode -> (address, port), from /proc (no psutil)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = {}
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = local.split(":")
            # The kernel prints the address as 32-bit words in host (little-endian) order.
            raw = b"".join(bytes.fromhex(hex_addr[i:i + 8])[::-1] for i in range(0, len(hex_addr), 8))
            found[inode] = (str(ipaddress.ip_address(raw[:width])), int(hex_port, 16))
    return found


class Net(nn.Module):
    """A three-layer MLP, 16 inputs, 4 classes."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 64)
        self.b = nn.Linear(64, 64)
        self.c = nn.Linear(64, 4)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def reference_grads(model, x, y, comm):
    """Plain reduction: local cross-entropy gradients, then one MPI allreduce each, divided by the size."""
    from mpi4py import MPI

    loss = nn.functional.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    out = []
    for g in grads:
        g = g.clone()
        comm.Allreduce(MPI.IN_PLACE, g.numpy(), op=MPI.SUM)
        out.append(g / comm.Get_size())
    return out


class FakeWork:
    """A torch.distributed work that logs its waits."""

    def __init__(self, log, op):
        self.log, self.op = log, op

    def wait(self, *args, **kwargs):
        self.log.append(("wait", self.op, args, kwargs))
        return True


class FakeComm:
    """A 4-rank job on 2 nodes as seen from rank 0, for the constructor's splits (no communication)."""

    def __init__(self, size=4, local=2):
        self.size, self.local = size, local

    def Get_size(self):
        return self.size

    def Split(self, color, key):
        return FakeComm(self.local if color == 0 and key == 0 else self.size // self.local, self.local)

    def allgather(self, item):
        return [(r // self.local, r % self.local) for r in range(self.size)]

    def Free(self):
        pass


def wait_for(condition, timeout_s):
    """Poll ``condition`` until it is true or ``timeout_s`` passed; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def rank_state(step, seq, op="step_boundary", bucket=-1, open_seq=0, open_op="none", open_s=0.0):
    """A rank's answer to a stall notice, as the monitor collects it (the flight recorder's part)."""
    return {"step": step, "seq": seq, "op": op, "bucket": bucket, "open_seq": open_seq, "open_op": open_op,
            "open_bucket": bucket if open_seq else -1, "open_s": open_s}


# --- checkpoints (tests/ckpt and the tests that save and load) ---------------------------------------------

def model_and_optimizers(seed=0):
    """A small model of every kind of state (embedding, batch norm, bf16, bool, zero-size buffers), SGD and AdamW."""
    import torch
    from torch import nn

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
    import torch

    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 300, (24,), generator=gen)
        for opt in optimizers:
            opt.zero_grad()
        model(x).square().mean().backward()
        for opt in optimizers:
            opt.step()


def split_state(model, sgd, adamw):
    """Model state with both optimizers' state (AdamW's under ``adamw/``), and both metas."""
    from hpcnet.ckpt.state import flatten_state

    tensors, meta = flatten_state(model, sgd)
    more, meta2 = flatten_state(model, adamw)
    tensors.update({k.replace("optim/", "adamw/", 1): v for k, v in more.items() if k.startswith("optim/")})
    return tensors, {"sgd": meta, "adamw": meta2}


def restore_split_state(model, sgd, adamw, tensors, meta):
    """Load what ``split_state`` returned back into ``model``, ``sgd`` and ``adamw``."""
    from hpcnet.ckpt.state import restore_state

    restore_state(model, sgd, tensors, meta["sgd"])
    adam = {k.replace("adamw/", "optim/", 1): v for k, v in tensors.items() if k.startswith("adamw/")}
    restore_state(model, adamw, {**{k: v for k, v in tensors.items() if k.startswith("model/")}, **adam},
                  meta["adamw"])


def assert_same_tensors(a, b):
    """Same names, dtypes, shapes and bits."""
    import torch

    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(-1).view(torch.uint8) if a[k].numel() else a[k],
                           b[k].view(-1).view(torch.uint8) if b[k].numel() else b[k]), k


def made_dir(comm, path):
    """``path``, made by rank 0 (collective): where every rank of a test writes."""
    if comm.Get_rank() == 0:
        path.mkdir(parents=True)
    comm.Barrier()
    return path


def fresh_dir(comm, path):
    """``path``, removed by rank 0 if it exists (collective)."""
    import shutil

    if comm.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    comm.Barrier()
    return path


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


def even_nodes(comm) -> dict[str, str]:
    """The environment for virtual nodes of 2 ranks (of 1 at an odd world size: a hierarchical all-reduce needs
    as many ranks on every node)."""
    return {"HPCNET_RANKS_PER_NODE": "2" if comm.Get_size() % 2 == 0 else "1"}


def owned_params(comm, sizes=(7, 1, 300, 2, 5)):
    """Parameters of ``sizes`` elements, each with an owner rank (a rank may own nothing at 4 ranks): the owner's
    holds ``arange + 1000 * index``, the others -1 (what ``ParamGather`` must give every rank)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    owner = [(i * 3) % size for i in range(len(sizes))]
    params = [torch.full((n,), -1.0) for n in sizes]
    for i, p in enumerate(params):
        if owner[i] == rank:
            p.copy_(torch.arange(p.numel(), dtype=torch.float32) + 1000 * i)
    return params, owner
