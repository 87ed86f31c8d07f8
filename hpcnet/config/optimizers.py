"""torch's optimizers by name (``optim.name``): the class, which of hpcnet's own ``optim.*`` options each takes,
and whether its update is elementwise; the two torch optimizers hpcnet refuses, and why.

An optimizer is *elementwise* when each element of a parameter is updated from that element's gradient and state
alone (SGD, Adam, ...): such an update may be split over row ranges of a parameter (``dist.zero`` cuts large ones).
Muon (a Newton-Schulz orthogonalisation of each matrix) and Adafactor (row and column statistics of each matrix)
are not: under ``dist.zero`` they are given whole parameters (``hpcnet.comm.sharding.layout``).
"""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KnownOptimizer:
    """A torch optimizer hpcnet builds by name.

    Attributes:
        cls: its class's name in ``torch.optim``.
        elementwise: whether its update is elementwise (see the module's doc).
        takes: the ``optim.*`` options it takes besides ``optim.lr`` (and ``optim.weight_decay``, wherever its
            constructor has one); every other keyword of its constructor comes from ``optim.options``.
    """

    cls: str
    elementwise: bool
    takes: tuple[str, ...] = ()


ADAM_LIKE = ("betas", "eps")
"""optim.betas and optim.eps keep Adam's meaning in these (Adafactor's and Muon's eps differ: optim.options)."""

OPTIMIZERS: dict[str, KnownOptimizer] = {
    "sgd": KnownOptimizer("SGD", True, ("momentum", "nesterov")),
    "adamw": KnownOptimizer("AdamW", True, ADAM_LIKE),
    "adam": KnownOptimizer("Adam", True, ADAM_LIKE),
    "nadam": KnownOptimizer("NAdam", True, ADAM_LIKE),
    "radam": KnownOptimizer("RAdam", True, ADAM_LIKE),
    "adamax": KnownOptimizer("Adamax", True, ADAM_LIKE),
    "adagrad": KnownOptimizer("Adagrad", True),
    "rmsprop": KnownOptimizer("RMSprop", True),
    "adadelta": KnownOptimizer("Adadelta", True),
    "asgd": KnownOptimizer("ASGD", True),
    "rprop": KnownOptimizer("Rprop", True),
    "adafactor": KnownOptimizer("Adafactor", False),
    # Muon over the hidden matrices, AdamW (optim.betas, optim.eps) over the rest: hpcnet.optim.muon.
    "muon": KnownOptimizer("Muon", False, ADAM_LIKE),
}
"""``optim.name`` -> the optimizer, in the order ``--help`` lists them."""

REFUSED: dict[str, str] = {
    "lbfgs": "it re-evaluates the loss through a closure several times a step, and hpcnet's loop steps once a batch",
    "sparseadam": "it takes sparse gradients only, and hpcnet's gradients are dense",
}
"""torch optimizers ``optim.name`` refuses, with the reason."""

ELEMENTWISE_CLASSES = frozenset({"lion_pytorch.lion_pytorch.Lion"})
"""Library optimizers (module.Class) known to be elementwise, for ``optim.factory``: a factory's optimizer is
taken as not elementwise unless listed here, its class says ``elementwise = True``, or ``optim.elementwise``."""

