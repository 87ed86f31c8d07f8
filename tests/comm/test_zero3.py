"""dist.zero=3: the parameters sharded too, gathered block by block (hpcnet.comm.sharding.params)."""

import io
import math
import types

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from hpcnet.comm.sharding.layout import ShardLayout
from hpcnet.comm.sharding.params import ShardedParams
from hpcnet.comm.transport import GroupGather
from hpcnet.fault.flightrec import DATA_PLANE_OPS, FlightRecorder
from hpcnet.models.blocks import checkpoint_blocks, find_blocks
from hpcnet.train import run
from tests.helpers.comm import even_nodes
from tests.helpers.data import tiny_images, tiny_tokens
from tests.helpers.train import assert_same, flat_params, train_config

MLP = ["model.name=mlp", "model.options.hidden=[32,24]"]
TRANSFORMER = ["model.name=transformer", "model.options.d_model=32", "model.options.n_layers=3",
               "model.options.n_heads=2"]


def _images(comm, tmp):
    return tiny_images(comm, tmp, "z3-images.h5", num_train=256, num_eval=32, seed=5)


def _tokens(comm, tmp):
    return tiny_tokens(comm, tmp, "z3-tokens.h5", num_train=128, num_eval=16, seq_len=16, vocab_size=64, seed=3)


def _cfg(tmp, dataset, name, *extra):
    return train_config(tmp, dataset, name, "train.steps=6", "optim.warmup_steps=2", "optim.grad_clip=0.5",
                        "optim.lr=0.2", "checkpoint.at_end=false", "dist.owners=uniform", *extra)


def _assert_same(a, b, exact):
    assert_same(a, b, exact, atol=5e-5)  # 20 AdamW steps of the transformer at 4 ranks: the bound


def _exact(comm, backend):
    """Stage 3 sums gradients as stage 2 does: MPI's reduce-scatter adds in stage 0's order up to 2 ranks; gloo
    and shm all-reduce in stage 0's layout (see test_zero)."""
    return comm.Get_size() <= 2 or backend != "mpi"


@pytest.mark.mpi
@pytest.mark.parametrize("model,optim,backend,extra", [
    ("mlp", "sgd", "mpi", []),
    ("mlp", "adamw", "mpi", ["optim.lr=0.003", "train.grad_accumulation=2"]),
    ("mlp", "sgd", "gloo", ["data.balance=auto", "data.balance_every=2"]),
    ("mlp", "adamw", "shm", ["optim.lr=0.003", "dist.progress=thread"]),
    ("resnet", "adamw", "mpi", ["optim.lr=0.003", "train.activation_checkpointing=blocks"]),
    ("transformer", "adamw", "mpi", ["optim.lr=0.003", "train.steps=20", "train.eval_every=20",
                                     "train.eval_batches=2"]),
    # bf16 autocast: a reduce-scatter's other order of summation moves AdamW's updates of near-zero gradients by
    # up to the learning rate at 3 ranks and more, at stage 2 as here: compared with stage 2, which sums alike.
    ("transformer", "adamw", "mpi", ["optim.lr=0.003", "train.precision=bf16", "reference=2"]),
])
def test_stage_3_trains_as_stage_0(comm, data_plane, mpi_tmp_path, model, optim, backend, extra):
    """The same parameters and losses as dist.zero=0 after 6 steps with clipping (20 for the transformer; bit for
    bit where the sums are taken in the same order); each rank holds only its own units between steps; the
    evaluation agrees."""
    reference = 2 if "reference=2" in extra else 0
    extra = [x for x in extra if x != "reference=2"]
    if model == "transformer":
        dataset, spec = _tokens(comm, mpi_tmp_path), TRANSFORMER
    elif model == "resnet":
        dataset, spec = _images(comm, mpi_tmp_path), ["model.name=resnet_tiny"]
    else:
        dataset, spec = _images(comm, mpi_tmp_path), MLP
    args = [*spec, f"optim.name={optim}", f"dist.backend={backend}", *extra]
    name = f"{model}-{optim}-{backend}-{len(extra)}"
    plain = run(_cfg(mpi_tmp_path, dataset, f"z{reference}-{name}", *args, f"dist.zero={reference}"), comm,
                plane=data_plane)
    sharded = run(_cfg(mpi_tmp_path, dataset, f"z3-{name}", *args, "dist.zero=3"), comm, plane=data_plane)
    # data.balance splits each batch by the speeds it measures, which differ from run to run: the same mean
    # gradient, summed from other splits.
    exact = (_exact(comm, backend) or reference == 2) and "data.balance=auto" not in extra
    _assert_same(flat_params(plain), flat_params(sharded), exact)
    assert sharded.summary["final_loss"] == pytest.approx(plain.summary["final_loss"], rel=1e-4)
    if "eval" in plain.summary:
        assert sharded.summary["eval"] == pytest.approx(plain.summary["eval"], rel=1e-4)
    # Each rank's units: memory for its own only, all units held once over the ranks; the optimizer's state too.
    layout, owner = sharded.optimizer.layout, sharded.optimizer.assignment.owner
    mine = {k for k, o in enumerate(owner) if o == comm.Get_rank()}
    assert {k for k, t in enumerate(layout.tensors) if t.untyped_storage().nbytes() > 0} == mine
    assert {k for k, t in enumerate(layout.tensors) if t in sharded.optimizer.state} == mine
    assert sharded.summary["comm"]["zero"] == 3
    comm.Barrier()


class _Net(nn.Module):
    """An embedding (root), three blocks, and an output layer tied to the embedding (root)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(3))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _sharded_net(comm, **kw):
    torch.manual_seed(0)
    net, reference = _Net(), _Net()
    reference.load_state_dict(net.state_dict())
    params = [p for p in net.parameters()]
    layout = ShardLayout(params, comm.Get_size())
    owner = [k % comm.Get_size() for k in range(len(layout.units))]
    blocks = find_blocks(net, "blocks.0,blocks.1,blocks.2")
    return net, reference, ShardedParams(net, layout, owner, comm, blocks, device=torch.device("cpu"), **kw)


def _held(sharded):
    return [g.index for g in sharded.groups if g.flat.untyped_storage().nbytes() > 0]


@pytest.mark.mpi
@pytest.mark.parametrize("collective,checkpointed", [("mpi", False), ("torch", False), ("mpi", True)])
def test_a_block_is_gathered_for_its_forward_and_backward_only(comm, data_plane, collective, checkpointed):
    """Between steps no parameter has memory; during a block's forward the root, the block and the next one
    (prefetched) do; during its backward the root, the block and the previous one, also where activation
    checkpointing recomputes the block's forward in backward without its hooks (the whole model stayed gathered);
    each rank's forward and gradients are the unsharded model's; the tied output layer is the root's."""
    net, reference, sharded = _sharded_net(comm, collective=collective)
    if checkpointed:
        checkpoint_blocks(find_blocks(net, "blocks.0,blocks.1,blocks.2"))
    assert sharded.groups[0].params == [0]  # the embedding (and head, the same tensor) stays in the root
    assert all(p.untyped_storage().nbytes() == 0 for p in net.parameters())
    seen: dict[str, list[list[int]]] = {"forward": [], "backward": []}
    for _b, block in enumerate(net.blocks):
        block.register_forward_pre_hook(lambda m, a: seen["forward"].append(_held(sharded)))
        block[0].weight.register_hook(lambda g: seen["backward"].append(_held(sharded)))
    x = torch.arange(12).reshape(3, 4) % 16
    with sharded.in_use():
        out = net(x)
        assert seen["forward"] == [[0, 1, 2], [0, 2, 3], [0, 3]]
        out.square().sum().backward()
        sharded.after_backward()
    assert seen["backward"] == [[0, 2, 3], [0, 1, 2], [0, 1]]
    assert all(p.untyped_storage().nbytes() == 0 for p in net.parameters())
    expected = reference(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    expected.square().sum().backward()
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    with torch.no_grad(), sharded.in_use():  # evaluation: every group released after its forward
        torch.testing.assert_close(net(x), expected.detach(), rtol=0, atol=0)
        assert _held(sharded) == []
    sharded.close()
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), reference.parameters()))  # unsharded
    comm.Barrier()


@pytest.mark.mpi
@pytest.mark.parametrize("collective", ["mpi", "torch"])
def test_every_gather_round_goes_through_the_transport_layer_into_the_flight_recorder(comm, data_plane, collective):
    """A round's traffic is the transport layer's (``GroupGather``), and each round is in the flight recorder, from
    the exchange of wants to the end of its traffic, as the data plane's buckets are (left out of the cross-rank
    comparison: the rounds fall between the buckets in an order that may differ by rank); one rank has none."""
    recorder = FlightRecorder()
    net, _, sharded = _sharded_net(comm, collective=collective, recorder=recorder)
    assert isinstance(sharded.rounds.gather, GroupGather)
    with sharded.in_use():
        net(torch.arange(8).reshape(2, 4)).square().sum().backward()
        sharded.after_backward()
    rounds = [e for e in recorder.entries() if e.op == "gather.round"]
    assert len(rounds) == sharded.rounds.rounds and (len(rounds) > 0) == (comm.Get_size() > 1)
    assert all(e.end is not None and e.bucket == -1 for e in rounds)
    assert "gather.round" in DATA_PLANE_OPS
    sharded.close()
    comm.Barrier()


@pytest.mark.mpi
def test_new_owners_keep_the_values(comm):
    net, reference, sharded = _sharded_net(comm)
    n = len(sharded.layout.units)
    sharded.reown([(k + 1) % comm.Get_size() for k in range(n)])
    for k, t in enumerate(sharded.layout.tensors):
        assert (t.untyped_storage().nbytes() > 0) == (sharded.owner[k] == comm.Get_rank())
    x = torch.arange(8).reshape(2, 4)
    with torch.no_grad(), sharded.in_use():
        torch.testing.assert_close(net(x), reference(x), rtol=0, atol=0)
    sharded.close()
    comm.Barrier()


@pytest.mark.mpi
def test_a_stage_3_checkpoint_resumes_on_one_rank_and_exports_whole(comm, data_plane, mpi_tmp_path):
    """Saved by every rank at stage 3 (the largest layer in row pieces from 2 ranks on): read by each rank alone at
    stages 0 and 3, and by all ranks at stage 0, the same parameters and optimizer state; ``ckpt export`` joins the
    pieces into the state dict of the model."""
    from hpcnet.ckpt.tool import cmd_export

    dataset = _images(comm, mpi_tmp_path)
    common = [*MLP, "optim.name=adamw", "optim.lr=0.003", "train.steps=3"]
    saved = run(_cfg(mpi_tmp_path, dataset, "z3-ws", *common, "dist.zero=3", "checkpoint.at_end=true"), comm,
                plane=data_plane)
    expected = flat_params(saved)
    ckpt = mpi_tmp_path / "ckpt" / "z3-ws"
    for zero, sub, where in ((0, MPI.COMM_SELF, f"self0-{comm.Get_rank()}"),
                             (3, MPI.COMM_SELF, f"self3-{comm.Get_rank()}"), (0, comm, "all")):
        cfg = train_config(mpi_tmp_path / where, dataset, "z3-ws", *common, f"dist.zero={zero}",
                           f"checkpoint.dir={ckpt}", "checkpoint.resume=auto", "checkpoint.at_end=false",
                           *(["dist.backend=mpi", "dist.fallback=none"] if sub is not comm else []))
        result = run(cfg, sub, plane=data_plane if sub is comm else None)
        assert result.summary["start_step"] == 3
        assert torch.equal(flat_params(result), expected), (zero, where)
    if comm.Get_rank() == 0:
        target = mpi_tmp_path / "z3.pt"
        assert cmd_export(sorted(ckpt.glob("ckpt-*.h5"))[-1], str(target), io.StringIO()) == 0
        state = torch.load(target, weights_only=True)
        assert list(state) == list(saved.model.state_dict())
        for key, value in saved.model.state_dict().items():
            assert torch.equal(state[key], value), key
        # --optimizer: the optimizer's state too, its pieces joined, as the unsharded optimizer's state_dict.
        assert cmd_export(sorted(ckpt.glob("ckpt-*.h5"))[-1], str(target), io.StringIO(), optimizer=True) == 0
        both = torch.load(target, weights_only=True)
        assert both["optimizer_class"] == "AdamW" and list(both["model"]) == list(state)
        expected_state = result.optimizer.state_dict()  # read back at stage 0 by every rank: the whole state
        assert both["optimizer"]["state"].keys() == expected_state["state"].keys()
        for index, values in expected_state["state"].items():
            for key, value in values.items():
                assert torch.equal(both["optimizer"]["state"][index][key], value), (index, key)
        from hpcnet.config.load import load_config
        from hpcnet.optim import build_optimizer

        fresh = build_optimizer(saved.model, load_config(overrides=["optim.name=adamw"]).optim)
        fresh.load_state_dict(both["optimizer"])  # as torch's own optimizer takes it
        assert fresh.param_groups[0]["lr"] == expected_state["param_groups"][0]["lr"]
    comm.Barrier()


def test_stage_4_is_named():
    from hpcnet.config.load import load_config
    from hpcnet.errors import ConfigError

    with pytest.raises(ConfigError, match=r"dist.zero: 4 is not one of 0, 1, 2, 3"):
        load_config(overrides=["dist.zero=4"])


# -- user code that stage 0 accepts (issue 44): models, losses and paths that differ by rank --------------------
class _Block(nn.Module):
    def __init__(self, width, namespace=False):
        super().__init__()
        self.lin, self.namespace = nn.Linear(width, width), namespace

    def forward(self, h):
        out = h + torch.tanh(self.lin(h))
        return types.SimpleNamespace(hidden=out) if self.namespace else out


class _UserNet(nn.Module):
    """An input layer, three blocks and a final norm and head outside them (the root); the options make the forward
    return a ``SimpleNamespace`` (blocks too), or skip block 1 on the last rank in training from forward
    ``skip_from`` on, and in evaluation always (a rank-dependent path, as data-dependent control flow gives)."""

    def __init__(self, info, width=16, namespace=False, skip_from=-1):
        super().__init__()
        features = math.prod(info.input_shape)
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(_Block(width, namespace) for _ in range(3))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, info.num_classes)
        self.namespace, self.skip_from, self.calls = namespace, skip_from, 0
        self.last = MPI.COMM_WORLD.Get_rank() == MPI.COMM_WORLD.Get_size() - 1 > 0

    def forward(self, x):
        h = self.inp(x.flatten(1))
        skip = self.last and self.skip_from >= 0 and (not self.training or self.calls >= self.skip_from)
        self.calls += self.training
        for b, block in enumerate(self.blocks):
            if b == 1 and skip:
                continue
            h = block(h).hidden if self.namespace else block(h)
        logits = self.head(self.norm(h))
        return types.SimpleNamespace(logits=logits) if self.namespace else logits


def user_net(info, **options):
    return _UserNet(info, **options)


def _ce(model, batch):
    x, y = batch
    out = model(x)
    return F.cross_entropy(getattr(out, "logits", out), y)


def l2_and_weight_norm(model, batch):
    """An L2 term over every parameter and a weight-norm metric: the parameters read after the forward."""
    loss = _ce(model, batch)
    l2 = sum(p.pow(2).sum() for p in model.parameters())
    norm = torch.sqrt(sum(p.detach().norm() ** 2 for p in model.parameters()))
    return loss + 1e-3 * l2, {"weight_norm": norm}


def second_forward_without_grad(model, batch):
    """A second forward under no_grad after the trained one, whose backward is still to come."""
    x, y = batch
    logits = model(x)
    with torch.no_grad():
        again = model(x)
    return F.cross_entropy(logits, y), {"same": (again.argmax(-1) == logits.argmax(-1)).float().mean()}


def idle_on_the_last_rank(model, batch):
    """In training, the last rank's loss does not depend on the model (its backward reaches no parameter)."""
    loss = _ce(model, batch)
    if model.training and MPI.COMM_WORLD.Get_rank() == MPI.COMM_WORLD.Get_size() - 1 > 0:
        return loss.detach() * 0 + torch.ones((), requires_grad=True)
    return loss


USER = ["model.factory=tests.comm.test_zero3:user_net", "model.blocks=blocks.0,blocks.1,blocks.2",
        "optim.name=adamw", "optim.lr=0.01", "train.eval_every=6"]


@pytest.mark.mpi
@pytest.mark.parametrize("case,extra", [
    ("skip", ["model.options.skip_from=0", "dist.find_unused=true"]),
    ("skip-late", ["model.options.skip_from=4", "dist.find_unused=true", "train.activation_checkpointing=blocks"]),
    # Virtual nodes: the hierarchical transport, whose start runs the intra-node phases (Reducer.pace).
    ("skip-nodes", ["model.options.skip_from=0", "dist.find_unused=true", "dist.hierarchical=on", "nodes"]),
    ("l2", ["model.loss=tests.comm.test_zero3:l2_and_weight_norm"]),
    ("no-grad-again", ["model.loss=tests.comm.test_zero3:second_forward_without_grad"]),
    ("namespace", ["model.options.namespace=true", "model.loss=tests.comm.test_zero3:_ce"]),
])
@pytest.mark.timeout(120)
def test_stage_3_runs_user_code_that_stage_0_runs(comm, data_plane, mpi_tmp_path, monkeypatch, case, extra):
    """Ranks that skip a block (from the first step, or from a later one under activation checkpointing; on one
    node and between virtual nodes), a loss that reads every parameter, a second forward without gradients,
    outputs in a SimpleNamespace: stage 3 trains and evaluates as stage 0 (bit for bit at up to 2 ranks), never
    hangs.  The evaluation set gives the ranks unequal numbers of batches (9 samples, batches of 4)."""
    if "nodes" in extra:
        monkeypatch.setenv("HPCNET_RANKS_PER_NODE", even_nodes(comm)["HPCNET_RANKS_PER_NODE"])
        extra = [x for x in extra if x != "nodes"]
    dataset = tiny_images(comm, mpi_tmp_path, "z3-user.h5", num_train=128, num_eval=9, seed=7)
    results = [run(_cfg(mpi_tmp_path, dataset, f"user-{case}-z{zero}", *USER, *extra, f"dist.zero={zero}"), comm,
                   plane=data_plane) for zero in (0, 3)]
    _assert_same(flat_params(results[0]), flat_params(results[1]), _exact(comm, "mpi"))
    assert results[1].summary["eval"] == pytest.approx(results[0].summary["eval"], rel=1e-4)
    comm.Barrier()


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_a_rank_whose_loss_reaches_no_parameter_is_an_error_on_every_rank_as_at_stage_0(comm, data_plane,
                                                                                         mpi_tmp_path):
    dataset = tiny_images(comm, mpi_tmp_path, "z3-user.h5", num_train=128, num_eval=9, seed=7)
    for zero in (0, 3):
        cfg = _cfg(mpi_tmp_path, dataset, f"idle-z{zero}", *USER, f"dist.zero={zero}",
                   "model.loss=tests.comm.test_zero3:idle_on_the_last_rank")
        if comm.Get_size() == 1:
            run(cfg, comm, plane=data_plane)
            continue
        with pytest.raises(RuntimeError, match="parameters received no gradient"):
            run(cfg, comm, plane=data_plane)
    comm.Barrier()


@pytest.mark.mpi
@pytest.mark.parametrize("collective", ["mpi", "torch"])
def test_ranks_that_use_different_blocks_get_the_gradients_of_their_own_paths(comm, data_plane, collective):
    """Rank r runs the blocks other than r % 3, reads the last block's weight after the forward, and its
    parameters' gradients are those of the unsharded model on the same path; the rounds agree whatever each
    rank wants."""
    net, reference, sharded = _sharded_net(comm, collective=collective)
    skip = comm.Get_rank() % 3

    def forward(model, x):
        h = model.embed(x)
        for b, block in enumerate(model.blocks):
            if b != skip:
                h = h + block(h)
        return model.head(h).square().sum() + model.blocks[2][2].weight.sum()
    x = torch.arange(12).reshape(3, 4) % 16
    with sharded.in_use():
        forward(net, x).backward()
        sharded.after_backward()
    forward(reference, x).backward()
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        if q.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    assert _held(sharded) == []
    sharded.close()
    comm.Barrier()


@pytest.mark.mpi
def test_between_steps_a_parameter_s_values_are_an_error_and_its_shape_and_state_dict_are_not(comm):
    net, reference, sharded = _sharded_net(comm)
    weight = net.blocks[0][0].weight
    assert weight.shape == (8, 8) and list(net.state_dict()) == list(reference.state_dict())
    with pytest.raises(RuntimeError, match=r"parameter blocks\.0\.0\.weight was read between steps"):
        weight.sum()
    with pytest.raises(RuntimeError, match="the model ran outside a step"):
        net(torch.zeros(1, 4, dtype=torch.long))
    sharded.close()
    assert type(weight) is nn.Parameter and torch.equal(weight, reference.blocks[0][0].weight)
    comm.Barrier()
