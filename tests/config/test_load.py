"""Config: defaults, TOML files, dotted overrides, errors that name the option."""

import pytest

from hpcnet.config import Config
from hpcnet.config.load import (
    check_same_config,
    config_hash,
    describe_options,
    field_docs,
    load_config,
    parse_command_line,
    parse_overrides,
    to_toml,
)
from hpcnet.errors import ConfigError


def test_defaults_are_valid():
    cfg = load_config()
    assert cfg == Config()
    assert cfg.train.steps > 0 and cfg.model.name == "resnet_tiny"


def test_overrides_in_both_spellings():
    cfg = load_config(overrides=["train.steps=7", "--optim.lr", "0.5", "--optim.name=adamw",
                                 "model.options.hidden=[64, 32]", "optim.betas=0.8,0.9", "--data.shuffle=false"])
    assert cfg.train.steps == 7
    assert cfg.optim.lr == 0.5 and cfg.optim.name == "adamw"
    assert cfg.model.options == {"hidden": [64, 32]}
    assert cfg.optim.betas == [0.8, 0.9]
    assert cfg.data.shuffle is False


def test_bare_flag_and_numbers_as_strings():
    assert parse_overrides(["--data.shuffle"]) == {"data": {"shuffle": True}}
    assert load_config(overrides=["run.name=2024"]).run.name == "2024"
    assert load_config(overrides=["optim.lr=1"]).optim.lr == 1.0


def test_toml_file_then_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[train]\nsteps = 11\nbatch_size = 8\n[model]\nname = "mlp"\noptions = {hidden = [16]}\n')
    cfg = load_config(path, ["train.steps=12"])
    assert (cfg.train.steps, cfg.train.batch_size, cfg.model.name) == (12, 8, "mlp")
    assert cfg.model.options == {"hidden": [16]}


def test_resolved_toml_round_trips(tmp_path):
    cfg = load_config(overrides=["model.options.hidden=[8,4]", "data.dataset=/x/y.h5", 'run.name=a"b'])
    path = tmp_path / "resolved.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg


@pytest.mark.parametrize("args, needle", [
    (["train.stepz=3"], "did you mean 'train.steps'"),
    (["train.steps=abc"], "train.steps: expected an integer"),
    (["train.steps=0"], "train.steps must be at least 1"),
    (["optim.name=lamb"], "optim.name"),
    (["optim.lr=-1"], "optim.lr"),
    (["optim.betas=[0.9]"], "optim.betas"),
    (["data.shuffle=maybe"], "data.shuffle: expected true or false"),
    (["train=3"], "train: is a section"),
    (["nosuch.key=1"], "unknown option 'nosuch'"),
    (["model.factory=notapath"], "model.factory"),
    (["dist.backend=mpi2"], "dist.backend"),
    (["run.metrics=some"], "run.metrics"),
    (["positional"], "section.key=value"),
    (["checkpoint.resume_else=/c/a.h5"], "checkpoint.resume_else needs checkpoint.resume=auto"),
    (["checkpoint.resume=auto", "checkpoint.resume_else=auto"], "checkpoint.resume_else must be a checkpoint"),
])
def test_errors_name_the_option(args, needle):
    with pytest.raises(ConfigError, match=None) as info:
        load_config(overrides=args)
    assert needle in str(info.value)


@pytest.mark.parametrize("old, new", [("dist.plan", "dist.owners"), ("dist.replan_every", "dist.reassign_every")])
def test_a_renamed_option_is_an_error_that_gives_its_new_name(tmp_path, old, new):
    """An old name is never taken silently nor called unknown: one line says what to set instead, from the command
    line and from a TOML file."""
    expected = f"option '{old}' was renamed '{new}': set {new} instead"
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"{old}=2"])
    assert str(info.value) == expected
    path = tmp_path / "old.toml"
    section, key = old.split(".")
    path.write_text(f"[{section}]\n{key} = 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == expected
    assert load_config(overrides=[f"{new}={getattr(Config().dist, new.split('.')[1])}"]) == Config()


@pytest.mark.parametrize("args, needle", [
    (["checkpoint.every_s=nan"], "checkpoint.every_s: expected a finite number, got nan"),
    (["monitor.stall_floor_s=nan"], "monitor.stall_floor_s: expected a finite number, got nan"),
    (["monitor.stall_timeout_s=inf"], "monitor.stall_timeout_s: expected a finite number, got inf"),
    (["dist.timeout_s=-inf"], "dist.timeout_s: expected a finite number, got -inf"),
    (["optim.betas=[nan, 0.9]"], "optim.betas[0]: expected a finite number, got nan"),
    (["train.steps=inf"], "train.steps: expected an integer, got inf"),
])
def test_non_finite_numbers_are_rejected_by_name(args, needle):
    """Nan compares false with everything, so it would pass every field's own range check."""
    with pytest.raises(ConfigError) as info:
        load_config(overrides=args)
    assert needle in str(info.value)


def test_non_finite_numbers_in_a_toml_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[checkpoint]\nevery_s = nan\n")
    with pytest.raises(ConfigError, match="checkpoint.every_s: expected a finite number"):
        load_config(path)


def test_an_option_toml_cannot_hold_is_named():
    cfg = load_config()
    cfg.model.options["make"] = object()  # possible from Python, not from TOML
    with pytest.raises(ConfigError, match="model.options: cannot write object to TOML"):
        to_toml(cfg)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="--config: file .* not found"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = ")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[train]\nbatch = 3\n")
    with pytest.raises(ConfigError, match="train.batch"):
        load_config(unknown)


def test_every_field_is_documented():
    import dataclasses
    import typing

    hints = typing.get_type_hints(Config)
    for section in dataclasses.fields(Config):
        docs = field_docs(hints[section.name])
        for f in dataclasses.fields(hints[section.name]):
            assert docs.get(f.name), f"{section.name}.{f.name} has no docstring"
    text = describe_options()
    assert "train.steps = 300" in text and "Number of optimizer steps" in text


def test_hash_tracks_content():
    assert config_hash(load_config()) == config_hash(load_config())
    assert config_hash(load_config()) != config_hash(load_config(overrides=["train.steps=5"]))


@pytest.mark.mpi
def test_same_config_passes_and_mismatch_fails_on_every_rank(comm):
    check_same_config(comm, load_config())
    if comm.Get_size() == 1:
        return
    cfg = load_config(overrides=[f"train.steps={100 + (comm.Get_rank() == comm.Get_size() - 1)}"])
    with pytest.raises(ConfigError, match=rf"ranks \[{comm.Get_size() - 1}\] differ"):
        check_same_config(comm, cfg)
    comm.Barrier()


def test_the_train_command_line():
    line = parse_command_line(["--config", "a.toml", "train.steps=3", "--resume", "auto", "--run.name", "x"])
    assert (line.config, line.resume, line.print_config, line.help) == ("a.toml", "auto", False, False)
    assert line.overrides == ["train.steps=3", "--run.name", "x"]
    assert parse_command_line(["--resume=/c/ckpt-5.h5"]).resume == "/c/ckpt-5.h5"
    assert parse_command_line(["-h"]).help and parse_command_line(["--print-config"]).print_config


@pytest.mark.parametrize("args, needle", [
    (["monitor.startup_timeout_s=1e12"], "monitor.startup_timeout_s must be at most 2592000 s (30 days), got 1e+12"),
    (["checkpoint.timeout_s=1e12"], "checkpoint.timeout_s must be at most 2592000 s (30 days), got 1e+12"),
    (["dist.timeout_s=1e18"], "dist.timeout_s must be at most 2592000 s (30 days), got 1e+18"),
    (["fault.sleep_s=1e10"], "fault.sleep_s must be at most 2592000 s (30 days), got 1e+10"),
    (["checkpoint.every_s=2592001"], "checkpoint.every_s must be at most 2592000 s (30 days), got 2592001"),
    (["monitor.heartbeat_misses=1000000000000"],
     "monitor.heartbeat_misses x monitor.heartbeat_interval_s (how long a rank may be silent) must be at most "
     "2592000 s (30 days), got 1000000000000 x 2 s"),
    (["run.seed=-1"], "run.seed must be an integer in [0, 2**63 - 1], got -1"),
    (["run.seed=9223372036854775808"], "run.seed must be an integer in [0, 2**63 - 1], got 9223372036854775808"),
    (["optim.eps=-1"], "optim.eps must be a positive number"),
    (["optim.eps=0"], "optim.eps must be a positive number"),
])
def test_out_of_range_values_name_the_option(args, needle):
    """Values that used to end in a traceback (OverflowError in a timer, a deadline or a timedelta; numpy's
    refusal of a negative seed; torch's of a negative epsilon) are refused where the config is read."""
    with pytest.raises(ConfigError) as info:
        load_config(overrides=args)
    assert needle in str(info.value)


def test_every_duration_option_is_bounded_in_one_place():
    """Every ``*_s`` option, including ones added later, accepts 0..30 days and names itself beyond."""
    import dataclasses
    import typing

    from hpcnet.config import MAX_DURATION_S

    hints = typing.get_type_hints(Config)
    durations = [f"{section.name}.{f.name}" for section in dataclasses.fields(Config)
                 for f in dataclasses.fields(hints[section.name]) if f.name.endswith("_s")]
    assert {"dist.timeout_s", "checkpoint.timeout_s", "monitor.startup_timeout_s", "fault.slow_s"} <= set(durations)
    for option in durations:
        misses = ["monitor.heartbeat_misses=1"] if option == "monitor.heartbeat_interval_s" else []
        cfg = load_config(overrides=[f"{option}={MAX_DURATION_S}", *misses])
        section, name = option.split(".")
        assert getattr(getattr(cfg, section), name) == MAX_DURATION_S
        with pytest.raises(ConfigError, match=rf"^{option} must be at most 2592000 s \(30 days\), got 2592000\.5$"):
            load_config(overrides=[f"{option}={MAX_DURATION_S + 0.5}", *misses])
