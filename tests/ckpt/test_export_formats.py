"""``python -m hpcnet.ckpt export --format pt|safetensors|hf``: what torch, safetensors readers and
``from_pretrained`` load, from short in-process training runs."""

import errno
import io
import json
import os
import stat
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from hpcnet.ckpt.export import unaliased, write_safetensors
from hpcnet.ckpt.tool import main as ckpt_main
from hpcnet.errors import UsageError
from hpcnet.models import build_model
from hpcnet.train import run
from tests.helpers.data import tiny_images
from tests.helpers.train import train_config

pytestmark = pytest.mark.timeout(240)
safetensors_torch = pytest.importorskip("safetensors.torch")
transformers = pytest.importorskip("transformers")

GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 256, "n_positions": 64,
        "bos_token_id": 0, "eos_token_id": 0}
"""A tiny GPT-2: 2 layers of width 32, vocabulary 256, 64 positions."""
HF_RUN = ("data.dir={data}", "train.steps=3", "optim.lr=0.01", "checkpoint.async_save=false")
"""A few steps of the tiny GPT-2 on synthetic-tokens (vocabulary 256, 64 tokens a sequence: the config's
vocab_size and n_positions), saved at the end."""


def write_config(directory):
    """The tiny GPT-2's config.json in ``directory``; its path."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(GPT2))
    return directory / "config.json"


def _hf_run(tmp, name, comm, *extra, plane=None):
    """Train the tiny GPT-2 (``model.hf``, its config.json under ``tmp``) on ``comm``; the result and its
    checkpoint directory."""
    config = write_config(tmp / "gpt2")
    cfg = train_config(tmp, "synthetic-tokens", name, f"model.hf={config}",
                       *(o.format(data=tmp / "data") for o in HF_RUN), *extra)
    result = run(cfg, comm, plane=plane)
    assert result.exit_code == 0 and result.summary["steps"] == 3, result.summary
    return result, tmp / "ckpt" / name


def _export(*args):
    out = io.StringIO()
    return ckpt_main(["export", *map(str, args)], out=out), out.getvalue()


def test_hf_export_loads_with_from_pretrained_and_computes_the_trained_logits(single_process, tmp_path):
    result, ckpt = _hf_run(tmp_path, "gpt2", MPI.COMM_SELF)
    out = tmp_path / "exported"
    status, said = _export(ckpt, "--format", "hf", "-o", out)
    assert status == 0 and "GPT2LMHeadModel" in said and "from_pretrained" in said
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors"}
    loaded, loading = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(loading.values()), loading  # no missing, unexpected or mismatched keys
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # the tie, as transformers makes it
    config = json.loads((out / "config.json").read_text())
    assert config["use_cache"] is True and config["n_layer"] == 2  # the run's config, not its training switches
    trained = result.model.eval()
    tokens = torch.randint(0, 256, (3, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(tokens).logits, trained(tokens).logits)  # bit for bit, fp32
    # An earlier export at -o is replaced; a directory holding anything else is not touched.
    assert _export(ckpt, "--format", "hf", "-o", out)[0] == 0
    (out / "notes.txt").write_text("mine")
    assert _export(ckpt, "--format", "hf", "-o", out)[0] == 2
    assert (out / "notes.txt").exists()
    assert json.loads((out / "hpcnet-export.json").read_text())["step"] == 3
    # Never over a model it did not write: the run's own model.hf directory, or another saved model.
    status, _ = _export(ckpt, "--format", "hf", "-o", tmp_path / "gpt2")
    assert status == 2 and json.loads((tmp_path / "gpt2" / "config.json").read_text())["n_layer"] == 2
    loaded.save_pretrained(tmp_path / "theirs")
    before = (tmp_path / "theirs" / "model.safetensors").read_bytes()
    assert _export(ckpt, "--format", "hf", "-o", tmp_path / "theirs")[0] == 2
    assert (tmp_path / "theirs" / "model.safetensors").read_bytes() == before
    # A config that moved: --hf-config names where it is now.
    (tmp_path / "gpt2").rename(tmp_path / "moved")
    status, _ = _export(ckpt, "--format", "hf", "-o", tmp_path / "again")
    assert status == 2 and not (tmp_path / "again").exists()
    assert _export(ckpt, "--format", "hf", "-o", tmp_path / "again", "--hf-config", tmp_path / "moved")[0] == 0
    # safetensors of the same run: every key, the tied two included, equal to the pt export.
    assert _export(ckpt, "--format", "safetensors", "-o", tmp_path / "m.safetensors")[0] == 0
    assert _export(ckpt, "-o", tmp_path / "m.pt")[0] == 0
    stored = safetensors_torch.load_file(tmp_path / "m.safetensors")
    plain = torch.load(tmp_path / "m.pt", weights_only=True)
    assert stored.keys() == plain.keys() == trained.state_dict().keys()
    assert all(torch.equal(stored[k], plain[k]) for k in plain)


def test_safetensors_round_trip_of_a_built_in_model(single_process, tmp_path):
    dataset = tiny_images(MPI.COMM_SELF, tmp_path, "images.h5", num_train=64, num_eval=16, seed=1)
    cfg = train_config(tmp_path, dataset, "mlp", "model.name=mlp", "model.options.hidden=[16]", "train.steps=2")
    result = run(cfg, MPI.COMM_SELF)
    out = tmp_path / "mlp.safetensors"
    status, said = _export(tmp_path / "ckpt" / "mlp", "--format", "safetensors", "-o", out)
    assert status == 0 and "safetensors.torch.load_file" in said
    state = safetensors_torch.load_file(out)
    fresh = build_model("mlp", _info(dataset), {"hidden": [16]})
    fresh.load_state_dict(state, strict=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), result.model.state_dict().values()))
    from safetensors import safe_open

    with safe_open(out, "pt") as f:
        assert f.metadata()["hpcnet_step"] == "2" and f.metadata()["format"] == "pt"
    # Without model.hf there is no config for from_pretrained: one line, naming the option and what to use.
    status = ckpt_main(["export", str(tmp_path / "ckpt" / "mlp"), "--format", "hf"], out=io.StringIO())
    assert status == 2


def _info(dataset):
    from hpcnet.data.h5 import open_split

    return open_split(dataset, "train").info


def test_format_hf_without_model_hf_is_one_line_naming_the_option(single_process, tmp_path, capsys):
    dataset = tiny_images(MPI.COMM_SELF, tmp_path, "images.h5", num_train=32, num_eval=8, seed=1)
    run(train_config(tmp_path, dataset, "mlp", "model.name=mlp", "model.options.hidden=[8]", "train.steps=1"),
        MPI.COMM_SELF)
    capsys.readouterr()
    assert ckpt_main(["export", str(tmp_path / "ckpt" / "mlp"), "--format", "hf"], out=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.hf" in err and "model.name='mlp'" in err and "--format safetensors" in err
    assert ckpt_main(["export", str(tmp_path / "ckpt" / "mlp"), "--hf-config", "x"], out=io.StringIO()) == 2
    assert "--hf-config is for --format hf only" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        ckpt_main(["export", str(tmp_path / "ckpt" / "mlp"), "--format", "onnx"])
    assert exited.value.code == 2


def test_safetensors_takes_tied_weights_under_each_name(tmp_path):
    model = build_model("transformer", _tokens_info(), {"d_model": 16, "n_layers": 1, "n_heads": 2})
    state = model.state_dict()
    assert state["head.weight"].data_ptr() == state["token_embedding.weight"].data_ptr()  # one tensor, two names
    copies, copied = unaliased(state)
    assert copied == ["head.weight"] and copies["head.weight"].data_ptr() != state["head.weight"].data_ptr()
    write_safetensors(state, tmp_path / "t.safetensors", {"hpcnet_step": "0"})
    stored = safetensors_torch.load_file(tmp_path / "t.safetensors")
    assert stored.keys() == state.keys() and all(torch.equal(stored[k], state[k]) for k in state)
    model.load_state_dict(stored, strict=True)
    assert model.head.weight is model.token_embedding.weight


def test_hf_export_of_a_sequence_classifier_keeps_its_labels(tmp_path):
    """The run's dataset is not at hand in export: the classifier and its number of labels come from the state."""
    from hpcnet.ckpt.export import write_hf

    config = write_config(tmp_path / "gpt2")
    info = type("Info", (), {"kind": "sequence", "input_shape": (16,), "num_classes": 5})()
    model = build_model("", info, {"pad_token_id": 0}, hf=str(config)).eval()
    assert write_hf(model.state_dict(), str(config), {"pad_token_id": 0}, tmp_path / "out") == \
        ("GPT2ForSequenceClassification", [])
    loaded, loading = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "out", output_loading_info=True)
    assert not any(loading.values()) and loaded.config.num_labels == 5 and loaded.config.pad_token_id == 0
    tokens = torch.randint(1, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(tokens).logits, model(tokens).logits)


def _lm_state(config):
    """A fresh causal LM's state dict, built from the tiny GPT-2's ``config``."""
    from hpcnet.data.info import DatasetInfo

    return build_model("", DatasetInfo("tokens", (16,), 256), {}, hf=str(config)).state_dict()


def test_hf_export_copies_only_regular_tokenizer_files_and_never_widens_them(tmp_path):
    """A model directory's tokenizer.json linked to a private file is left out, said so, not copied 0644 into a
    directory meant to be shared; a copy is no more readable than its source; a FIFO is neither copied nor waited
    on, and one at -o is refused."""
    from hpcnet.ckpt.export import write_hf

    config = write_config(tmp_path / "gpt2")
    secret = tmp_path / "secret.json"
    secret.write_text("private")
    secret.chmod(0o600)
    (tmp_path / "gpt2" / "tokenizer.json").symlink_to(secret)
    (tmp_path / "gpt2" / "vocab.json").write_text("{}")
    (tmp_path / "gpt2" / "vocab.json").chmod(0o640)
    os.mkfifo(tmp_path / "gpt2" / "merges.txt")
    umask = os.umask(0o022)
    try:
        name, left_out = write_hf(_lm_state(config), str(config.parent), {}, tmp_path / "out")  # the directory
    finally:
        os.umask(umask)
    out = tmp_path / "out"
    assert name == "GPT2LMHeadModel" and not (out / "tokenizer.json").exists() and not (out / "merges.txt").exists()
    assert [n for n in left_out if "tokenizer.json" in n and "symbolic link" in n]
    assert [n for n in left_out if "merges.txt" in n and "not a regular file" in n]
    assert stat.S_IMODE((out / "vocab.json").stat().st_mode) == 0o640
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o644  # written here: the umask's
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UsageError, match="is a FIFO, not a directory"):
        write_hf(_lm_state(config), str(config), {}, tmp_path / "fifo")
    assert stat.S_ISFIFO((tmp_path / "fifo").stat().st_mode)


def test_hf_export_into_the_working_directory_replaces_its_files_in_place(tmp_path, monkeypatch):
    """``-o .`` from inside an earlier export: the caller's working directory stays (never renamed away and made
    anew), with the new export's files and nothing else, and from_pretrained('.') loads it."""
    from hpcnet.ckpt.export import write_hf

    config = write_config(tmp_path / "gpt2")
    state = _lm_state(config)
    out = tmp_path / "out"
    write_hf(state, str(config), {}, out, {"step": 1})
    names, inode = sorted(p.name for p in out.iterdir()), out.stat().st_ino
    monkeypatch.chdir(out)
    write_hf(state, str(config), {}, Path("."), {"step": 2})
    assert os.getcwd() == str(out) and Path(".").stat().st_ino == inode
    assert sorted(p.name for p in out.iterdir()) == names  # no staging folder left
    assert json.loads(Path("hpcnet-export.json").read_text())["step"] == 2
    transformers.AutoModelForCausalLM.from_pretrained(".")


@pytest.mark.parametrize("fail_at", [1, 6])
def test_a_failed_hf_export_over_an_earlier_one_leaves_that_one_whole(tmp_path, monkeypatch, fail_at):
    """A rename into the output directory fails (the first, or one part way through): every file of the earlier
    export is back, byte for byte, and nothing else is there."""
    from hpcnet.ckpt.export import write_hf

    config = write_config(tmp_path / "gpt2")
    state = _lm_state(config)
    out = tmp_path / "out"
    write_hf(state, str(config), {}, out, {"step": 1})
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    moves = []

    def failing(real):
        def rename(src, dst, *args, **kwargs):
            if out in (Path(dst), Path(dst).parent, Path(src).parent):  # into, or out of, the output directory
                moves.append(dst)
                if len(moves) == fail_at:
                    raise OSError(errno.EIO, "injected")
            return real(src, dst, *args, **kwargs)
        return rename
    monkeypatch.setattr(os, "rename", failing(os.rename))
    monkeypatch.setattr(os, "replace", failing(os.replace))
    with pytest.raises(OSError, match="injected"):
        write_hf(state, str(config), {}, out, {"step": 2})
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def _tokens_info():
    from hpcnet.data.info import DatasetInfo

    return DatasetInfo("tokens", (8,), 32)


def _keys_shapes(directory):
    from safetensors import safe_open

    with safe_open(directory / "model.safetensors", "pt") as f:
        names = f.keys()
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in names}


@pytest.mark.mpi
@pytest.mark.parametrize("zero", [0, 2, 3])
def test_a_sharded_runs_hf_export_is_the_one_rank_runs(comm, data_plane, mpi_tmp_path, zero):
    """A 2-rank run, replicated (0), with a sharded optimizer (2) or sharded parameters in row pieces (3), exports
    what a one-rank run exports, key for key; the tied weights stay one parameter through the broadcast and the
    sharding."""
    tmp = mpi_tmp_path / f"zero{zero}"
    result, ckpt = _hf_run(tmp, "sharded", comm, f"dist.zero={zero}", plane=data_plane)
    assert result.model.lm_head.weight is result.model.transformer.wte.weight
    found, error = None, None
    if comm.Get_rank() == 0:  # one process exports, as the tool runs; what it finds is asserted on every rank
        threads = torch.get_num_threads()  # the one-rank run sets its own: the next tests' sums must not differ
        try:
            found = _exports(tmp, ckpt)
        except Exception as exc:  # noqa: BLE001 - shared, so that the other ranks fail too instead of waiting
            error = repr(exc)
        finally:
            torch.set_num_threads(threads)
    found, error = comm.bcast((found, error), root=0)
    assert error is None, error
    one, sharded, one_config, sharded_config, tied = found
    assert tied  # trained as one parameter, saved under both names
    assert sharded == one and "lm_head.weight" not in sharded  # stored once, as transformers ties it
    assert sharded_config == one_config
    comm.Barrier()


_ONE_RANK_EXPORT: dict[str, Path] = {}
"""The one-rank run's hf export, made once a session: every stage compares against the same one."""


def _one_rank_export(tmp):
    if "hf" not in _ONE_RANK_EXPORT:
        _, one = _hf_run(tmp / "one", "one", MPI.COMM_SELF)
        assert _export(one, "--format", "hf", "-o", tmp / "one-hf")[0] == 0
        _ONE_RANK_EXPORT["hf"] = tmp / "one-hf"
    return _ONE_RANK_EXPORT["hf"]


def _exports(tmp, ckpt):
    """The sharded run's hf export and a one-rank run's, by keys, shapes and dtypes; their config.json; whether
    the checkpoint's two names of the tied weight hold the same values."""
    assert _export(ckpt, "--format", "hf", "-o", tmp / "sharded-hf")[0] == 0
    one = _one_rank_export(tmp)
    assert _export(ckpt, "-o", tmp / "sharded.pt")[0] == 0
    saved = torch.load(tmp / "sharded.pt", weights_only=True)
    return (_keys_shapes(one), _keys_shapes(tmp / "sharded-hf"), json.loads((one / "config.json").read_text()),
            json.loads((tmp / "sharded-hf" / "config.json").read_text()),
            torch.equal(saved["lm_head.weight"], saved["transformer.wte.weight"]))


def test_a_sequence_classifier_trains_on_sequences_and_exports_for_from_pretrained(single_process, tmp_path):
    """A 'sequence' dataset (one class a sequence) under model.hf: AutoModelForSequenceClassification with the
    dataset's classes, trained with the default cross-entropy of its .logits, evaluated with accuracy; its hf
    export loads with from_pretrained and computes the trained logits."""
    config = write_config(tmp_path / "gpt2")
    cfg = train_config(tmp_path, "examples.objectives:parity", "seq", f"model.hf={config}",
                       "model.options.pad_token_id=0", "data.options.n=256", "train.steps=6", "train.eval_every=6",
                       "optim.name=adamw", "optim.lr=0.003", "checkpoint.async_save=false")
    result = run(cfg, MPI.COMM_SELF)
    assert result.exit_code == 0 and type(result.model).__name__ == "GPT2ForSequenceClassification"
    assert result.model.config.num_labels == 2 and set(result.summary["eval"]) == {"eval_loss", "eval_accuracy"}
    assert _export(tmp_path / "ckpt" / "seq", "--format", "hf", "-o", tmp_path / "seq-hf")[0] == 0
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "seq-hf").eval()
    tokens = torch.randint(1, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, result.model.eval()(tokens).logits)


@pytest.mark.parametrize("fmt", ["pt", "safetensors", "hf"])
def test_a_failed_export_leaves_nothing_and_says_so_in_one_line(single_process, tmp_path, capsys, fmt):
    """A full disk (a file size limit here) stops the write: status 2, one line naming the output, no temporary
    file left, an earlier export at -o kept; a directory where a file goes is refused."""
    import resource

    _, ckpt = _hf_run(tmp_path, "gpt2", MPI.COMM_SELF)
    out = tmp_path / "out" / ("model" if fmt == "hf" else f"model.{fmt}")
    out.parent.mkdir()
    assert _export(ckpt, "--format", fmt, "-o", out)[0] == 0
    kept = sorted(p.name for p in out.iterdir()) if fmt == "hf" else out.read_bytes()
    capsys.readouterr()
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, limits[1]))
    try:
        import signal

        previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
        status, _ = _export(ckpt, "--format", fmt, "-o", out)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and f"cannot write {str(out)!r}" in err and "Traceback" not in err
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no temporary file beside it
    assert (sorted(p.name for p in out.iterdir()) if fmt == "hf" else out.read_bytes()) == kept
    if fmt != "hf":
        assert _export(ckpt, "--format", fmt, "-o", tmp_path / "out")[0] == 2  # a directory
