"""The memory planner: a step's transient memory measured, each stage's peak predicted, the choice under a cap,
the same in a run (dist.memory_cap_gb) and from the command line (python -m hpcnet.plan)."""

import json
import subprocess
import sys

import pytest
import torch

from hpcnet.data.info import DatasetInfo
from hpcnet.errors import ExitCode, UsageError
from hpcnet.models import build_model
from hpcnet.objective import compute_loss
from hpcnet.plan.measure import ModelMemory, StepMemory, measure_model
from hpcnet.plan.peaks import choose, largest_share, predict, predictions
from hpcnet.train import run
from tests.helpers.data import shared_data_dir, tiny_images
from tests.helpers.launch import clean_env
from tests.helpers.train import train_config

MB = 10**6


def _memory(params=100 * MB, backward=40 * MB, optimizer=2 * MB, blocks_backward=10 * MB):
    shapes = [(params // 4 // 1000, 1000)]
    memory = ModelMemory(sizes=[params], shapes=shapes, block_share=0.9, n_blocks=4)
    common = dict(optimizer=optimizer, batch=8, state_bytes=2 * params)
    memory.steps["off"] = StepMemory(backward=backward, forward_backward_s=1.0,
                                     timeline=((backward, 0), (5 * MB, params)), **common)
    memory.steps["blocks"] = StepMemory(backward=blocks_backward, forward_backward_s=1.3,
                                        timeline=((blocks_backward, 0), (5 * MB, params)), **common)
    return memory


def test_each_stage_keeps_less_and_the_parts_add_up():
    memory = _memory()
    p0, p1, p2 = (predict(memory, ranks=4, stage=s, checkpointing="off") for s in (0, 1, 2))
    assert p0.peak == 100 * MB + 100 * MB + 200 * MB + 40 * MB  # parameters, buckets, AdamW state, the step
    share = largest_share(memory, 4)
    assert 25 * MB <= share <= 30 * MB  # one matrix cut into rows for 4 owners
    assert p1.peak == 100 * MB + 100 * MB + 2 * share + 40 * MB
    assert p2.grads == share and p2.peak < p1.peak < p0.peak
    # At stage 2 the kept share of each gradient grows through the backward: its peak is the larger of the two
    # moments of the timeline (40 MB alive with nothing handed over, 5 MB with everything).
    bucket = min(25 * 2**20, share // 4 // 65536 * 65536)
    assert p2.transient == max(40 * MB, 5 * MB + share) + 2 * bucket
    assert predict(memory, ranks=4, stage=2, checkpointing="blocks").peak < p2.peak
    # Stage 3 keeps its share of the parameters, and holds the root (10% here) and one block (of 4) whole.
    p3 = predict(memory, ranks=4, stage=3, checkpointing="off")
    assert p3.params == share + 10 * MB + 90 * MB // 4 and p3.peak < p2.peak and p3.grads == share
    assert predict(memory, ranks=4, stage=0, checkpointing="off", batch=16).transient == 80 * MB  # scales


def test_the_choice_is_the_fastest_that_fits_and_nothing_fitting_names_what_would():
    memory = _memory()
    fastest = predictions(memory, ranks=4)[0]
    assert (fastest.stage, fastest.checkpointing) == (0, "off")
    assert choose(memory, ranks=4, cap_bytes=fastest.peak).stage == 0
    tight = predict(memory, ranks=4, stage=2, checkpointing="off").peak
    chosen = choose(memory, ranks=4, cap_bytes=tight)
    assert (chosen.stage, chosen.checkpointing) == (2, "off") and chosen.peak <= tight
    # Stage 3 keeps a share of the parameters too: its peak is the least.
    least = predict(memory, ranks=4, stage=3, checkpointing="blocks").peak
    assert least < predict(memory, ranks=4, stage=2, checkpointing="blocks").peak
    with pytest.raises(UsageError, match=r"dist.memory_cap_gb=0.12: no choice fits at 4 ranks; the least is "
                                         r"dist.zero=3, activation checkpointing blocks.*would fit: \d+ ranks"):
        choose(memory, ranks=4, cap_bytes=int(0.12e9))
    assert least > 0.12e9
    # Stage 3 shares the parameters out: more ranks fit where stage 2 would need more memory a rank ...
    with pytest.raises(UsageError, match=r"would fit: \d+ ranks at dist.zero=3"):
        choose(memory, ranks=4, cap_bytes=50 * MB)
    # ... but not what a rank holds whole in a step (the root, a block, the activations).
    with pytest.raises(UsageError, match="neither more ranks nor a smaller batch fits: more memory per rank"):
        choose(memory, ranks=4, cap_bytes=20 * MB)


def test_auto_checkpoints_only_as_many_blocks_as_the_cap_needs():
    memory = _memory()
    by_blocks = [predict(memory, ranks=4, stage=0, checkpointing=k) for k in range(5)]
    assert [p.checkpointing for p in by_blocks] == ["off", "1 of 4 blocks", "2 of 4 blocks", "3 of 4 blocks", "blocks"]
    peaks = [p.peak for p in by_blocks]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] - peaks[4] == 30 * MB  # measured: 40 MB -> 10 MB
    assert peaks[2] == peaks[0] - 15 * MB  # half the blocks, half the saving
    # A cap between 2 and 3 blocks' peaks at stage 0, below stage 2 without any: the fastest fitting choice.
    chosen = choose(memory, ranks=1, cap_bytes=peaks[2], checkpointing="auto")
    assert (chosen.stage, chosen.blocks) == (0, 2)
    assert choose(memory, ranks=1, cap_bytes=peaks[0], checkpointing="auto").blocks == 0  # fits without
    with pytest.raises(UsageError, match="no choice fits"):
        choose(memory, ranks=1, cap_bytes=peaks[2], checkpointing="off")


def test_auto_needs_a_cap():
    from hpcnet.config.load import load_config
    from hpcnet.errors import ConfigError

    with pytest.raises(ConfigError, match="train.activation_checkpointing=auto needs dist.memory_cap_gb"):
        load_config(overrides=["train.activation_checkpointing=auto"])
    assert load_config(overrides=["train.activation_checkpointing=auto", "dist.memory_cap_gb=1"]).dist.memory_cap_gb


def test_the_measured_step_sees_activations_and_checkpointing_shrinks_them():
    torch.manual_seed(0)
    model = build_model("transformer", DatasetInfo("tokens", (32,), 512), {"d_model": 64, "n_layers": 4,
                                                                          "n_heads": 2})
    before = [p.detach().clone() for p in model.parameters()]
    batch = (torch.randint(0, 512, (16, 32)), torch.randint(0, 512, (16, 32)))
    memory = measure_model(model, lambda m: torch.optim.AdamW(m.parameters(), lr=0.1), compute_loss, batch)
    off, blocks = memory.steps["off"], memory.steps["blocks"]
    logits = 16 * 32 * 512 * 4
    assert off.backward > 2 * logits  # the logits, their softmax and their gradient at least
    assert blocks.backward < off.backward
    # AdamW: two moments, and a step count a parameter
    assert 2 * memory.param_bytes <= off.state_bytes <= 2 * memory.param_bytes + 8 * len(memory.sizes)
    assert memory.block_share > 0.5
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the model is left as it was
    assert all(p.grad is None for p in model.parameters())
    assert not any(getattr(b, "_hpcnet_checkpointed", False) for b in model.blocks)


def _measured(name, **options):
    """A small transformer measured with ``optim.name=name`` as a run builds it (``measure_config``'s way)."""
    from hpcnet.config import OptimConfig
    from hpcnet.optim import build_optimizer, is_elementwise

    torch.manual_seed(0)
    model = build_model("transformer", DatasetInfo("tokens", (16,), 256), {"d_model": 64, "n_layers": 2,
                                                                          "n_heads": 2})
    cfg = OptimConfig(name=name, lr=1e-3, **options)
    batch = (torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16)))
    return model, measure_model(model, lambda m: build_optimizer(m, cfg), compute_loss, batch,
                                elementwise=is_elementwise(build_optimizer(model, cfg), cfg))


def test_the_planner_counts_what_each_optimizer_keeps_parameter_by_parameter():
    model, adamw = _measured("adamw")
    sizes = adamw.sizes
    matrices = [i for i, p in enumerate(p for p in model.parameters() if p.requires_grad) if p.dim() == 2]
    state = adamw.steps["off"].state_sizes
    assert all(2 * size <= kept <= 2 * size + 8 for size, kept in zip(sizes, state))  # two moments and a count
    assert adamw.elementwise
    assert _measured("sgd", momentum=0.0)[1].steps["off"].state_bytes == 0  # nothing kept between steps
    _, adafactor = _measured("adafactor")
    assert not adafactor.elementwise
    factored = adafactor.steps["off"].state_sizes
    assert all(factored[i] < sizes[i] / 8 for i in matrices)  # a row and a column of each matrix, not its size
    _, muon = _measured("muon")
    assert not muon.elementwise
    kept = muon.steps["off"].state_sizes
    assert any(kept[i] == sizes[i] for i in matrices)  # Muon's momentum on the hidden matrices
    assert all(kept[i] >= 2 * sizes[i] for i in range(len(sizes)) if i not in matrices)  # AdamW on the rest


def test_a_non_elementwise_optimizer_s_share_is_its_owner_s_whole_matrices():
    """One 40 MB matrix and four small ones at 4 ranks: cut into rows its owners share it; whole, one owner keeps
    it all, and its state with it."""
    sizes = [40 * MB] + [MB] * 4
    shapes = [(10_000, 1000)] + [(250, 1000)] * 4
    for elementwise in (True, False):
        memory = ModelMemory(sizes=sizes, shapes=shapes, block_share=0.0, elementwise=elementwise)
        memory.steps["off"] = StepMemory(backward=MB, optimizer=MB, batch=8, state_bytes=sum(sizes) // 10,
                                         forward_backward_s=1.0, state_sizes=tuple(s // 10 for s in sizes))
        p1 = predict(memory, ranks=4, stage=1, checkpointing="off")
        if elementwise:
            assert largest_share(memory, 4) <= 12 * MB and p1.optimizer <= 12 * MB // 10
        else:
            assert largest_share(memory, 4) == 40 * MB and p1.optimizer == 4 * MB


def test_a_parameter_too_large_for_its_one_owner_names_the_optimizers_that_would_fit_it():
    """A 40 MB matrix whole on one of 4 ranks does not fit where its rows spread over them would: nothing fitting
    names an elementwise optimizer; more ranks do not help (the matrix stays whole)."""
    sizes = [40 * MB] + [MB] * 4
    shapes = [(10_000, 1000)] + [(250, 1000)] * 4
    memory = ModelMemory(sizes=sizes, shapes=shapes, block_share=0.0, elementwise=False)
    memory.steps["off"] = StepMemory(backward=MB, optimizer=MB, batch=8, state_bytes=2 * sum(sizes),
                                     forward_backward_s=1.0, state_sizes=tuple(2 * s for s in sizes))
    cut = ModelMemory(sizes=sizes, shapes=shapes, block_share=0.0, steps=memory.steps)
    cap = min(p.peak for p in predictions(cut, ranks=4, checkpointing="off"))
    assert cap < min(p.peak for p in predictions(memory, ranks=4, checkpointing="off"))
    with pytest.raises(UsageError, match=r"would fit: an elementwise optimizer at dist.zero=\d \(optim.name=adamw, "
                                         r".*the largest 40.0 MB\)"):
        choose(memory, ranks=4, cap_bytes=cap, checkpointing="off")
    assert choose(cut, ranks=4, cap_bytes=cap, checkpointing="off").stage > 0


def test_the_cap_picks_the_stage_for_the_optimizer_the_run_chose():
    """Under a cap that SGD without momentum meets unsharded, AdamW (two moments a parameter) needs a sharded
    stage."""
    _, sgd = _measured("sgd", momentum=0.0)
    _, adamw = _measured("adamw")
    cap = predict(sgd, ranks=4, stage=0, checkpointing="off").peak
    assert choose(sgd, ranks=4, cap_bytes=cap).stage == 0
    assert choose(adamw, ranks=4, cap_bytes=cap).stage >= 1
    assert predict(adamw, ranks=4, stage=0, checkpointing="off").peak > cap


def _dataset(comm, tmp):
    return tiny_images(comm, tmp, "plan-images.h5", num_train=128, num_eval=16, seed=4)


@pytest.mark.mpi
@pytest.mark.parametrize("cap_gb", [5, 1e300])
def test_a_capped_run_takes_the_planner_s_choice_and_reports_the_measured_peak(comm, data_plane, mpi_tmp_path,
                                                                               cap_gb):
    dataset = _dataset(comm, mpi_tmp_path)
    cfg = train_config(mpi_tmp_path, dataset, f"capped-{cap_gb:g}", "train.steps=3", "model.name=mlp",
                       "model.options.hidden=[1024,1024]", "optim.name=adamw", "checkpoint.at_end=false",
                       f"dist.memory_cap_gb={cap_gb}", "train.activation_checkpointing=auto", "dist.zero=2")
    result = run(cfg, comm, plane=data_plane)
    plan = result.summary["memory_plan"]
    # 5 GB (or any larger cap): the fastest fits, with no block checkpointed; the planner's stage replaces dist.zero=2
    assert (plan["stage"], plan["activation_checkpointing"], plan["blocks"]) == (0, "off", 0)
    assert 0 < plan["peak_bytes"] <= 5e9 and plan["measured_peak_bytes"] > 0
    assert result.summary["comm"]["zero"] == 0
    comm.Barrier()


@pytest.mark.launch
def test_a_cap_nothing_fits_under_stops_every_rank_naming_it(launch, tmp_path):
    out = launch(2, f"data.dir={shared_data_dir(tmp_path)}", f"run.dir={tmp_path / 'runs'}", "train.steps=5",
                 "model.name=mlp", "model.options.hidden=[512,512]", "dist.memory_cap_gb=0.001", timeout=120)
    assert out.returncode == ExitCode.USAGE_ERROR, out.stderr
    assert "dist.memory_cap_gb=0.001: no choice fits at 2 ranks" in out.stderr
    assert "Traceback" not in out.stderr and "MPI_ABORT" not in out.stderr


def test_python_m_hpcnet_plan_prints_every_choice_and_the_one_under_the_cap(tmp_path):
    args = [sys.executable, "-m", "hpcnet.plan", "--ranks", "4", f"data.dir={shared_data_dir(tmp_path)}",
            "model.name=mlp", "model.options.hidden=[256,256]", "optim.name=adamw", "train.batch_size=8"]
    out = subprocess.run([*args, "--cap-gb", "1", "--json", str(tmp_path / "owners.json")], env=clean_env(),
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "under 1 GB a rank, train.activation_checkpointing=off: dist.zero=0, activation checkpointing off" \
        in out.stdout
    saved = json.loads((tmp_path / "owners.json").read_text())
    assert len(saved["predictions"]) == 8 and saved["chosen"]["stage"] == 0  # 4 stages, with and without
    peaks = {(p["stage"], p["activation_checkpointing"]): p["peak_bytes"] for p in saved["predictions"]}
    assert peaks[(0, "off")] > peaks[(1, "off")] > peaks[(2, "off")]
    bad = subprocess.run([*args, "--cap-gb", "0.0001"], env=clean_env(), capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert bad.returncode == ExitCode.USAGE_ERROR
    assert bad.stderr.startswith("hpcnet.plan: error: --cap-gb=0.0001: no choice fits at 4 ranks")
    assert "Traceback" not in bad.stderr


def _plan(capsys, *argv):
    """``python -m hpcnet.plan ARGV`` in this process: its status, stdout and stderr."""
    from hpcnet.plan.__main__ import main

    status = main([str(a) for a in argv])
    said = capsys.readouterr()
    return status, said.out, said.err


GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 256, "n_positions": 64,
        "bos_token_id": 0, "eos_token_id": 0}
"""A tiny GPT-2 for synthetic-tokens (vocabulary 256, 64 tokens a sequence)."""


@pytest.mark.parametrize("extra", [[], ["model.name=transformer"]])
def test_the_planner_measures_the_hugging_face_model_that_the_same_options_train(tmp_path, capsys, extra):
    pytest.importorskip("transformers")
    config = tmp_path / "gpt2.json"
    config.write_text(json.dumps(GPT2))
    gpt2 = build_model("", DatasetInfo("tokens", (64,), 256), {}, hf=str(config))
    status, out, err = _plan(capsys, f"model.hf={config}", "data.dataset=synthetic-tokens",
                             f"data.dir={tmp_path / 'data'}", "train.batch_size=2", *extra)
    assert status == 0, err
    parameters = sum(p.numel() for p in gpt2.parameters())
    assert out.startswith(f"model hf {config}: {parameters:,} parameters"), out


def test_a_huge_cap_is_met_by_the_fastest_choice(tmp_path, capsys):
    """1e300 GB: every choice fits, so the planner takes the fastest, as under any cap above every peak (a cap in
    bytes past a 64-bit address space is that space)."""
    args = [f"data.dir={tmp_path / 'data'}", "model.name=mlp", "model.options.hidden=[16]", "train.batch_size=4"]
    status, out, err = _plan(capsys, "--cap-gb", "1e300", *args)
    assert status == 0, err
    assert "under 1e+300 GB a rank, train.activation_checkpointing=off: dist.zero=0, activation checkpointing off" \
        in out
    status, out, err = _plan(capsys, "dist.memory_cap_gb=1e300", *args)
    assert status == 0 and "under 1e+300 GB a rank" in out, err


@pytest.mark.parametrize("where", ["missing/owners.json", "."])
def test_a_json_file_that_cannot_be_written_is_one_line_naming_it(tmp_path, capsys, where):
    target = tmp_path / where
    status, _, err = _plan(capsys, "--json", target, f"data.dir={tmp_path / 'data'}", "model.name=mlp",
                             "model.options.hidden=[16]", "train.batch_size=4")
    assert status == ExitCode.USAGE_ERROR
    assert err.startswith(f"hpcnet.plan: error: --json {target}: cannot write it: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("ranks", ["0", str(2**20 + 1), str(10**20)])
def test_a_rank_count_out_of_range_is_a_usage_error(tmp_path, capsys, ranks):
    """10^20 ranks was an OverflowError traceback; the owner plan is per rank, so the planner stops at 2^20."""
    with pytest.raises(SystemExit) as exc:
        _plan(capsys, "--ranks", ranks, f"data.dir={tmp_path / 'data'}")
    assert exc.value.code == ExitCode.USAGE_ERROR
    assert capsys.readouterr().err.endswith(f"error: --ranks must be from 1 to 1048576, got {ranks}\n")
