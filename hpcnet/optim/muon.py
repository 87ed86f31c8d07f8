"""Muon with its companion AdamW (``optim.name=muon``), as torch's Muon documentation prescribes: Muon for the
hidden layers' matrices, AdamW for everything else.

The hidden matrices (``hidden_weights``) are the 2-D parameters other than the embeddings' (``nn.Embedding``) and
the output layer's (the model's last ``nn.Linear``, and any parameter tied to an embedding): Muon orthogonalises a
hidden layer's update, which suits neither a table looked up row by row nor the logits' projection.  Biases, norm
weights and convolutions' 4-D kernels go to AdamW too (``torch.optim.Muon`` takes 2-D parameters only).

``MuonWithAdamW`` is one ``torch.optim.Optimizer``: one state dict, one set of param groups, each group saying
which update it takes (``"update": "muon"`` or ``"adamw"``) and carrying that optimizer's hyperparameters.  So the
loop's learning rate, the sharded optimizer (which rebuilds it over the units a rank owns) and checkpoints treat
it as any other optimizer.  Its update is not elementwise: each Muon matrix is stepped whole, by its owner.
"""

from typing import Any

import torch
from torch import nn

MUON, ADAMW = "muon", "adamw"
"""The ``update`` of a param group."""


def hidden_weights(model: nn.Module) -> set[int]:
    """The ids of ``model``'s hidden matrices (see the module's doc)."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    head = {id(linears[-1].weight)} if linears else set()
    return {id(p) for p in model.parameters() if p.dim() == 2 and id(p) not in embedded | head}


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon over the param groups whose ``update`` is ``"muon"``, AdamW over the others.

    Args:
        params: param groups, each with ``"update"`` and the keywords of that optimizer it sets (the rest take
            torch's defaults): ``torch.optim.Muon``'s or ``torch.optim.AdamW``'s.
    """

    elementwise = False

    def __init__(self, params: Any) -> None:
        groups = [dict(g) for g in params]
        for g in groups:
            if g.get("update") not in (MUON, ADAMW):
                raise ValueError(f"a param group's update is {g.get('update')!r}, not {MUON!r} or {ADAMW!r}")
        # Each inner optimizer fills in its defaults on these same dicts (add_param_group keeps them) and checks
        # its parameters (Muon: 2-D only); this optimizer then owns the dicts, and steps through them.
        self._inner = {
            MUON: torch.optim.Muon([g for g in groups if g["update"] == MUON] or [{"params": []}]),
            ADAMW: torch.optim.AdamW([g for g in groups if g["update"] == ADAMW] or [{"params": []}]),
        }
        super().__init__(groups, {})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One Muon step over the Muon groups, one AdamW step over the others, on this optimizer's state."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for update, inner in self._inner.items():
            # load_state_dict replaces the groups and the state: the inner optimizers follow them every step.
            inner.param_groups = [g for g in self.param_groups if g["update"] == update]
            inner.state = self.state
            if inner.param_groups:
                inner.step()
        return loss
