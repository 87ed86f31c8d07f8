"""The optimizer by name, with options, or from a factory (``hpcnet.optim.build``): each of torch's steps, each bad
input names its option, the default job's optimizer is the one it always was."""

import pytest
import torch
from torch import nn

from hpcnet.config.load import load_config
from hpcnet.config.optimizers import OPTIMIZERS
from hpcnet.errors import ConfigError, UsageError
from hpcnet.optim import build_optimizer, is_elementwise
from hpcnet.optim.muon import ADAMW, MUON, MuonWithAdamW


class _Net(nn.Module):
    """An embedding, a hidden layer, a norm and an output layer: every kind of parameter Muon's split sorts."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.hidden = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.norm(torch.relu(self.hidden(self.embed(x)))))


def _optim(*overrides):
    return load_config(overrides=list(overrides)).optim


def _step(model, optimizer):
    model(torch.arange(6) % 10).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_by_name_builds_with_weight_decay_groups_and_steps(name):
    torch.manual_seed(0)
    model = _Net()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = build_optimizer(model, _optim(f"optim.name={name}", "optim.weight_decay=0.01", "optim.lr=0.01"))
    _step(model, optimizer)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert optimizer.state  # it keeps state, which checkpoints hold
    decays = {id(p): g.get("weight_decay", 0.0) for g in optimizer.param_groups for p in g["params"]}
    assert sorted(id(p) for p in model.parameters()) == sorted(decays)
    assert all(decays[id(p)] == 0.0 for p in model.parameters() if p.dim() < 2)
    if "weight_decay" in optimizer.defaults or name == "muon":
        assert all(decays[id(p)] == 0.01 for p in model.parameters() if p.dim() >= 2)


def test_the_default_optimizer_is_the_sgd_it_was():
    model = _Net()
    cfg = _optim()
    ours = build_optimizer(model, cfg)
    params = list(model.parameters())
    theirs = torch.optim.SGD([{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=cfg.lr, momentum=cfg.momentum, nesterov=False, fused=None)
    assert type(ours) is torch.optim.SGD
    assert ours.state_dict() == theirs.state_dict()


def test_options_reach_the_optimizer_and_lists_become_tuples():
    optimizer = build_optimizer(_Net(), _optim("optim.name=rprop", "optim.options.etas=[0.4,1.3]",
                                               "optim.options.maximize=true"))
    assert optimizer.defaults["etas"] == (0.4, 1.3) and optimizer.defaults["maximize"] is True
    assert "weight_decay" not in optimizer.param_groups[0]  # Rprop has none: not smuggled into its groups
    adamw = build_optimizer(_Net(), _optim("optim.name=adamw", "optim.options.amsgrad=true", "optim.betas=[0.8,0.9]"))
    assert adamw.defaults["amsgrad"] is True and adamw.defaults["betas"] == (0.8, 0.9)


def test_muon_steps_the_hidden_matrices_and_adamw_the_rest():
    model = _Net()
    optimizer = build_optimizer(model, _optim("optim.name=muon", "optim.options.ns_steps=4"))
    assert isinstance(optimizer, MuonWithAdamW) and not is_elementwise(optimizer, _optim("optim.name=muon"))
    by_update = {u: {id(p) for g in optimizer.param_groups if g["update"] == u for p in g["params"]}
                 for u in (MUON, ADAMW)}
    assert by_update[MUON] == {id(model.hidden.weight)}
    assert id(model.embed.weight) in by_update[ADAMW] and id(model.head.weight) in by_update[ADAMW]
    assert [g["ns_steps"] for g in optimizer.param_groups if g["update"] == MUON] == [4]
    _step(model, optimizer)
    assert set(optimizer.state[model.hidden.weight]) == {"momentum_buffer"}
    assert set(optimizer.state[model.head.weight]) == {"step", "exp_avg", "exp_avg_sq"}


def test_muon_with_adamw_equals_torch_s_muon_and_adamw_side_by_side():
    """The composite's step is torch's Muon on its groups and torch's AdamW on the others, bit for bit, and a
    state dict round trip goes on alike."""
    torch.manual_seed(1)
    a, b = _Net(), _Net()
    b.load_state_dict(a.state_dict())
    composite = build_optimizer(a, _optim("optim.name=muon", "optim.lr=0.01"))
    muon = torch.optim.Muon([b.hidden.weight], lr=0.01, weight_decay=5e-4, adjust_lr_fn="match_rms_adamw")
    rest = [p for p in b.parameters() if p is not b.hidden.weight]
    adamw = torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2], "weight_decay": 5e-4},
                               {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}], lr=0.01)
    for step in range(3):
        _step(a, composite)
        b(torch.arange(6) % 10).square().mean().backward()
        muon.step()
        adamw.step()
        b.zero_grad()
        if step == 1:  # load_state_dict replaces the groups and the state: the steps after follow them
            composite.load_state_dict(composite.state_dict())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("overrides, needle", [
    (["optim.name=adafactor", "optim.options.bogus=1"],
     "optim.options.bogus: adafactor (Adafactor) takes no option 'bogus'; it takes beta2_decay, eps, d, foreach"),
    (["optim.name=adafactor", "optim.options.beta2_decay=0.5"],
     "optim.options.beta2_decay: adafactor refuses 0.5: beta2_decay should be <= 0"),
    (["optim.name=adamw", "optim.options.amsgrad=yes"], "optim.options.amsgrad: adamw takes a bool"),
    (["optim.name=adam", "optim.options.eps=1e-3"], "optim.options.eps: set optim.eps instead"),
    (["optim.name=sgd", "optim.options.lr=1"], "optim.options.lr: set optim.lr instead"),
    (["optim.name=adamw", "optim.options.fused=true"], "optim.options.fused: set cuda.fused_optimizer instead"),
    (["optim.name=muon", "optim.options.adjust_lr_fn=x"], "optim.options.adjust_lr_fn: muon refuses 'x'"),
    (["optim.name=muon", "optim.options.ns_coefficients=[1,2]"], "optim.options.ns_coefficients: muon refuses"),
    (["optim.name=muon", "optim.options.betas=[0.9,0.9]"], "optim.options.betas: muon (Muon) takes no option"),
])
def test_a_bad_option_names_itself(overrides, needle):
    with pytest.raises(ConfigError) as caught:
        build_optimizer(_Net(), _optim(*overrides))
    assert needle in str(caught.value)


@pytest.mark.parametrize("overrides, needle", [
    (["optim.name=lbfgs"], "optim.name: 'lbfgs' is not supported: it re-evaluates the loss through a closure"),
    (["optim.name=sparseadam"], "optim.name: 'sparseadam' is not supported: it takes sparse gradients only"),
    (["optim.name=lamb"], "optim.name: 'lamb' is not one of 'sgd', 'adamw'"),
    (["optim.factory=nocolon"], "optim.factory: 'nocolon' is not of the form 'package.module:function'"),
    (["optim.elementwise=true"], "optim.elementwise is for optim.factory's optimizer"),
])
def test_a_bad_name_is_refused_with_the_reason(overrides, needle):
    with pytest.raises(ConfigError, match=None) as caught:
        _optim(*overrides)
    assert needle in str(caught.value)


# --- optim.factory --------------------------------------------------------------------------------------------------

class Tagged(torch.optim.SGD):
    """A user's optimizer that declares its update elementwise."""

    elementwise = True


class Unknown(torch.optim.SGD):
    """A user's optimizer that declares nothing."""


def sgd_factory(param_groups, cfg):
    return Tagged(param_groups, lr=cfg.lr, momentum=cfg.options.get("momentum", 0.0))


def lion_factory(param_groups, cfg):
    from lion_pytorch import Lion

    return Lion(param_groups, lr=cfg.lr)


def raising_factory(param_groups, cfg):
    raise RuntimeError("no such optimizer here")


def not_an_optimizer(param_groups, cfg):
    return param_groups


def test_a_factory_gets_the_weight_decay_groups_and_the_section():
    model = _Net()
    cfg = _optim("optim.factory=tests.optim.test_build:sgd_factory", "optim.options.momentum=0.5", "optim.lr=0.2")
    optimizer = build_optimizer(model, cfg)
    assert type(optimizer) is Tagged and optimizer.defaults["momentum"] == 0.5 and optimizer.defaults["lr"] == 0.2
    assert [g["weight_decay"] for g in optimizer.param_groups] == [cfg.weight_decay, 0.0]
    assert is_elementwise(optimizer, cfg)


def test_a_factory_s_optimizer_is_elementwise_only_when_said():
    model = _Net()
    lion = build_optimizer(model, _optim("optim.factory=tests.optim.test_build:lion_factory"))
    assert is_elementwise(lion, _optim("optim.factory=tests.optim.test_build:lion_factory"))  # a known library class
    plain = _optim("optim.factory=hpcnet.optim:build_optimizer")
    said = _optim("optim.factory=hpcnet.optim:build_optimizer", "optim.elementwise=true")
    unknown = Unknown(model.parameters(), lr=0.1)
    assert not is_elementwise(unknown, plain) and is_elementwise(unknown, said)
    adafactor = torch.optim.Adafactor(model.parameters())  # known not to be: optim.elementwise does not change it
    assert not is_elementwise(adafactor, plain) and not is_elementwise(adafactor, said)


@pytest.mark.parametrize("factory, needle", [
    ("nopkg_here.mod:fn", "optim.factory: cannot import module 'nopkg_here.mod'"),
    ("tests.optim.test_build:missing", "optim.factory: module 'tests.optim.test_build' has no attribute 'missing'"),
    ("tests.optim.test_build:raising_factory",
     "optim.factory: tests.optim.test_build:raising_factory raised RuntimeError: no such optimizer here"),
    ("tests.optim.test_build:not_an_optimizer",
     "optim.factory: tests.optim.test_build:not_an_optimizer returned a list, not a torch.optim.Optimizer"),
])
def test_a_bad_factory_names_optim_factory(factory, needle):
    with pytest.raises(UsageError) as caught:
        build_optimizer(_Net(), _optim(f"optim.factory={factory}"))
    assert needle in str(caught.value)


def test_the_log_line_says_what_each_group_updates_and_whether_owners_hold_whole_parameters():
    from hpcnet.config import OptimConfig
    from hpcnet.optim.build import describe

    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    muon = build_optimizer(model, OptimConfig(name="muon"))
    assert describe(muon, False) == (
        "optimizer MuonWithAdamW: muon over 1 tensor(s) (64 parameters), adamw over 4 tensor(s) (172 parameters); "
        "not elementwise: every parameter is owned whole")
    sgd = build_optimizer(model, OptimConfig())
    assert describe(sgd, True).startswith("optimizer SGD: over 5 tensor(s) (236 parameters); elementwise")
