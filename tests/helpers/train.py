"""Small training runs: their Config, and a stand-in for the stop signal."""

import signal
from pathlib import Path


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


def flat_params(result):
    """A run's parameters (``run(...).model``), flat in model order."""
    import torch

    return torch.cat([p.detach().reshape(-1) for p in result.model.parameters()])


def assert_same(a, b, exact, atol=1e-5):
    """Bit for bit where the summation orders agree, else to the rounding of other orders."""
    import torch

    if exact:
        assert torch.equal(a, b), (a - b).abs().max()
    else:
        torch.testing.assert_close(b, a, rtol=1e-4, atol=atol)
