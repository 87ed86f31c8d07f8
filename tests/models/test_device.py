"""The ``cuda.*`` device settings: what they resolve to per device, and training with the ones that also run on
CPU (channels-last, fused optimizers) equal across ranks, close to the default, and resumable without them."""

import logging
import os

import numpy as np
import pytest
import torch
from torch import nn

from hpcnet.config import CudaConfig
from hpcnet.config.load import load_config
from hpcnet.models.device import BatchMover, DeviceSettings, apply_settings, device_settings
from hpcnet.train import run
from tests.helpers.data import tiny_images
from tests.helpers.launch import ROOT

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def _cnn():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 4))


def test_auto_is_everything_on_cuda_and_nothing_on_cpu():
    assert device_settings(CudaConfig(), CPU, _cnn()) == DeviceSettings()  # a CPU run is what it was
    assert device_settings(CudaConfig(), CUDA, _cnn()) == DeviceSettings(
        cudnn_benchmark=True, matmul_precision="high", channels_last=True, pin_memory=True, fused_optimizer=True)
    off = CudaConfig(cudnn_benchmark="off", matmul_precision="highest", channels_last="off", pin_memory="off",
                     fused_optimizer="off")
    assert device_settings(off, CUDA, _cnn()) == DeviceSettings()


def test_what_cannot_apply_is_logged_not_applied(caplog):
    on = CudaConfig(cudnn_benchmark="on", channels_last="on", pin_memory="on", fused_optimizer="on",
                    matmul_precision="medium")
    with caplog.at_level(logging.INFO, logger="hpcnet.models.device"):
        cpu = device_settings(on, CPU, _cnn())
        mlp = device_settings(on, CUDA, nn.Linear(3, 2))
    assert cpu == DeviceSettings(matmul_precision="medium", channels_last=True, fused_optimizer=True)
    assert not mlp.channels_last  # no 2-d convolution: nothing to reorder
    for words in ("cuda.cudnn_benchmark=on has no effect on cpu", "cuda.pin_memory=on has no effect on cpu",
                  "cuda.channels_last=on has no effect: the model has no 2-d convolution"):
        assert words in caplog.text
    with pytest.raises(ValueError, match="cuda.channels_last: 'yes' is not one of 'auto', 'on', 'off'"):
        load_config(overrides=["cuda.channels_last=yes"])
    with pytest.raises(ValueError, match="cuda.matmul_precision: 'tf32' is not one of"):
        load_config(overrides=["cuda.matmul_precision=tf32"])


def test_channels_last_reorders_the_model_and_its_4d_inputs_only():
    settings = DeviceSettings(channels_last=True)
    model = apply_settings(settings, _cnn())
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert not model[0].weight.is_contiguous()
    images, labels = BatchMover(CPU, settings)((torch.randn(2, 3, 8, 8), torch.tensor([1, 2])))
    assert images.is_contiguous(memory_format=torch.channels_last) and labels.is_contiguous()
    plain, _ = BatchMover(CPU, DeviceSettings())((torch.randn(2, 3, 8, 8), torch.tensor([1, 2])))
    assert plain.is_contiguous()
    torch.set_float32_matmul_precision("highest")  # apply_settings set it process-wide


def _config(dataset, run_dir, ckpt_dir, *extra):
    return load_config(overrides=[
        f"data.dataset={dataset}", f"run.dir={run_dir}", "run.dir_exact=true", f"checkpoint.dir={ckpt_dir}",
        "train.batch_size=8", "train.steps=4", "train.eval_every=0", "model.name=resnet_tiny",
        "model.options.width=4", "optim.warmup_steps=1", "optim.lr=0.1", "checkpoint.every_steps=2",
        "checkpoint.async_save=false", *extra])


_CHANNELS_LAST_PROBE = """
import copy, torch
from torch import nn
from hpcnet.data.info import DatasetInfo
from hpcnet.models import build_model

torch.manual_seed(0)
base = build_model("resnet_tiny", DatasetInfo("image", (1, 16, 16), 4), {"width": 4})
x, y = torch.randn(8, 1, 16, 16).contiguous(memory_format=torch.channels_last), torch.randint(0, 4, (8,))
ends = []
for _ in range(2):
    model = copy.deepcopy(base).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(8):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    ends.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
print("same" if torch.equal(ends[0], ends[1]) else "differ")
"""


def _channels_last_is_deterministic() -> str:
    """Why torch alone cannot train this model in channels-last with the same bits twice here ('' when it can).

    In a child process with a deadline: on this project's AMD EPYC (AVX2) machines torch 2.13's channels-last
    backward was seen to differ between two identical runs, to abort, and (in the serial pass) to hang."""
    import subprocess
    import sys

    try:
        out = subprocess.run([sys.executable, "-c", _CHANNELS_LAST_PROBE], capture_output=True, text=True,
                             timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        return "torch's channels-last CPU backward hung here (a torch-only probe, 60 s)"
    if out.returncode != 0:
        return f"torch's channels-last CPU backward failed here (a torch-only probe, status {out.returncode})"
    if out.stdout.strip() != "same":
        return "torch's channels-last CPU training is not deterministic on this machine"
    return ""


def _params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_channels_last_and_fused_sgd_train_like_the_default_and_resume_without_them(comm, data_plane, mpi_tmp_path):
    # On some AMD EPYC (AVX2) machines torch 2.13's channels-last training is not bit-reproducible (two torch-only
    # runs ended 0.0035 apart after 8 steps) and a 2-rank run of this test crashed inside backward: skipped there,
    # on every rank alike, where the probe (on rank 0: the ranks of a test job share its machine) finds it so.
    why = comm.bcast(_channels_last_is_deterministic() if comm.Get_rank() == 0 else None, root=0)
    if why:
        pytest.skip(why)
    dataset = tiny_images(comm, mpi_tmp_path, "accel-images.h5", num_train=96, num_eval=8, seed=5)
    plain = run(_config(dataset, mpi_tmp_path / "plain", mpi_tmp_path / "plain-ckpt"), comm, plane=data_plane)
    fast = run(_config(dataset, mpi_tmp_path / "fast", mpi_tmp_path / "fast-ckpt", "cuda.channels_last=on",
                       "cuda.fused_optimizer=on"), comm, plane=data_plane)
    conv = next(m for m in fast.model.modules() if isinstance(m, nn.Conv2d) and m.in_channels > 1)
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert fast.optimizer.defaults["fused"]
    mine = _params(fast.model)
    every = comm.allgather(mine.numpy().tobytes())
    assert all(b == every[0] for b in every), "the replicas diverged"
    # Other kernels (channels-last convolutions, one fused update): equal to rounding, not bit for bit.  With
    # channels-last parameters and contiguous gradient views the fused update was wrong by 0.06 after 8 steps.
    assert torch.allclose(mine, _params(plain.model), rtol=1e-4, atol=1e-5)
    assert np.isclose(fast.summary["final_loss"], plain.summary["final_loss"], rtol=1e-4)
    # Its checkpoint resumes in a default run (logical layout is what is saved) and trains on.
    resumed = run(_config(dataset, mpi_tmp_path / "resumed", mpi_tmp_path / "fast-ckpt", "train.steps=5",
                          "checkpoint.resume=auto"), comm, plane=data_plane)
    assert resumed.summary["start_step"] == 4 and np.isfinite(resumed.summary["final_loss"])
