"""bench recovery's command line: the defaults that depend on ``--cluster`` and the options it refuses."""

import pytest

from hpcnet.bench.recovery import _checked, _parser, _train_args


def _args(*argv):
    parser = _parser()
    args = parser.parse_args(list(argv))
    return args, _checked(parser, args)


def test_the_defaults_are_the_single_host_ones_or_the_cluster_ones():
    args, modes = _args()
    assert (args.np, args.steps, args.kill_at, args.trials, args.settle_s) == (2, 40, 25, 5, 10.0)
    assert modes == ["cold", "warm"]
    args, _ = _args("--cluster")
    assert (args.np, args.steps, args.kill_at, args.trials, args.settle_s) == (4, 80, 13, 2, 3.0)
    args, modes = _args("--cluster", "--np", "3", "--modes", "warm")
    assert args.np == 3 and modes == ["warm"]  # what is given is kept


def test_every_run_trains_the_same_job_with_the_extra_options_last():
    args, _ = _args("--steps", "30", "--settle-s", "0", "dist.probe=false")
    options = _train_args(args)
    assert "train.steps=30" in options and options[-1] == "dist.probe=false"
    assert not any(o.startswith("fault.sleep") for o in options)  # --settle-s 0: no sleep at step 2


@pytest.mark.parametrize("argv, message", [
    (["--kill-at", "50"], "need 2 < --every-steps < --kill-at < --steps"),
    (["--modes", "hot"], "--modes takes cold, warm or both"),
    (["--trials", "0"], "--trials must be at least 1"),
])
def test_a_bad_option_is_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _args(*argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
