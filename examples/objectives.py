"""Your own objective, model and data with hpcnet: small examples, each a command (docs/data.md, "Your own objective").

Regression with a mean squared error and a metric of its own (a dataset of float targets, kind 'other')::

    python -m hpcnet.train data.dataset=examples.objectives:regression model.factory=examples.objectives:regressor \
        model.loss=examples.objectives:mse

A model that computes its own loss from a dict batch (``model(**batch).loss``, as a Hugging Face model given
``labels`` does), with no ``model.loss``::

    python -m hpcnet.train data.dataset=examples.objectives:dict_tokens model.factory=examples.objectives:self_loss

Run them from the repository's root (``examples`` is imported from the working directory).
"""

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


class Regression(torch.utils.data.Dataset):
    """``n`` samples of ``features`` normal inputs and one float target, a fixed linear function of them plus
    noise; the same weights for both splits, other samples (the seed is ``seed``, and ``seed + 1`` for eval)."""

    def __init__(self, split: str, n: int = 2048, features: int = 16, seed: int = 0) -> None:
        weights = torch.randn(features, generator=torch.Generator().manual_seed(seed))
        g = torch.Generator().manual_seed(seed + (split == "eval"))
        self.x = torch.randn(n, features, generator=g)
        self.y = self.x @ weights + 0.1 * torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]  # float targets: kind 'other', for model.loss


def regression(split: str, **options: int) -> Regression:
    """``data.dataset`` factory of ``Regression``; ``data.options`` are its keyword arguments."""
    return Regression(split, **options)


def regressor(info, hidden: int = 64) -> nn.Module:
    """``model.factory``: a two-layer network from the inputs' width (``info.input_shape``) to one output."""
    return nn.Sequential(nn.Linear(info.input_shape[0], hidden), nn.ReLU(), nn.Linear(hidden, 1))


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``model.loss``: the mean squared error, and the mean absolute error as a metric (logged, evaluated)."""
    x, y = batch
    prediction = model(x).squeeze(-1)
    return F.mse_loss(prediction, y), {"mae": (prediction - y).abs().mean()}


class DictTokens(torch.utils.data.Dataset):
    """Token rows as dicts: ``input_ids``, ``attention_mask`` (ones, and zeros over a padded tail of some rows)
    and ``labels`` (-100 where padded: not counted), the next token being the current one plus one, modulo
    ``vocab``."""

    def __init__(self, split: str, n: int = 512, seq_len: int = 16, vocab: int = 32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed + (split == "eval"))
        start = torch.randint(0, vocab, (n, 1), generator=g)
        self.ids = (start + torch.arange(seq_len)) % vocab
        lengths = torch.randint(seq_len // 2, seq_len + 1, (n,), generator=g)
        self.mask = (torch.arange(seq_len) < lengths[:, None]).long()
        self.num_classes = vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = torch.where(self.mask[i].bool(), self.ids[i], -100)
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": labels}


def dict_tokens(split: str, **options: int) -> DictTokens:
    """``data.dataset`` factory of ``DictTokens``."""
    return DictTokens(split, **options)


class SelfLoss(nn.Module):
    """A tiny causal model over tokens that returns its own loss when given ``labels``, as Hugging Face models do:
    ``model(input_ids, attention_mask, labels).loss`` is the cross-entropy of each unmasked position's next
    token."""

    def __init__(self, vocab: int, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Sequential(nn.Linear(width, width), nn.GELU())
        self.out = nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> SimpleNamespace:
        logits = self.out(self.mix(self.embed(input_ids)))
        loss = None
        if labels is not None:
            # position t predicts the token at t + 1: shift, as causal language models do
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        return SimpleNamespace(loss=loss, logits=logits)


def self_loss(info, width: int = 64) -> nn.Module:
    """``model.factory`` of ``SelfLoss`` for the dataset's vocabulary (``info.num_classes``)."""
    return SelfLoss(info.num_classes, width)


class Parity(torch.utils.data.Dataset):
    """Token sequences with one class each (kind 'sequence'): whether the count of tokens below ``vocab // 2`` in
    the sequence is even or odd; for a sequence classifier (``model.hf`` builds
    ``AutoModelForSequenceClassification`` on such data)."""

    def __init__(self, split: str, n: int = 1024, seq_len: int = 16, vocab: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed + (split == "eval"))
        self.x = torch.randint(1, vocab, (n, seq_len), generator=g)  # 0 left for padding
        self.y = (self.x < vocab // 2).sum(1) % 2
        self.num_classes = 2

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def parity(split: str, **options: int) -> Parity:
    """``data.dataset`` factory of ``Parity``."""
    return Parity(split, **options)
