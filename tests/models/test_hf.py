"""hpcnet.models.hf: ``model.hf`` builds a Hugging Face transformers model from a local config or directory."""

import io
import json
import sys
from dataclasses import dataclass

import pytest
import torch

from hpcnet.data.info import DatasetInfo
from hpcnet.errors import ConfigError
from hpcnet.models import build_model
from hpcnet.models.blocks import find_blocks
from tests.helpers.launch import clean_env

pytest.importorskip("transformers")

GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 256, "n_positions": 64,
        "bos_token_id": 0, "eos_token_id": 0}
"""A tiny GPT-2: 2 layers of width 32, vocabulary 256, 64 positions."""
TOKENS = DatasetInfo("tokens", (16,), 200)
LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}
"""A tiny LLaMA (with GPT2's vocabulary)."""


@dataclass(frozen=True)
class Info:
    """A DatasetInfo of any kind (the kinds 'sequence' and 'other' come from user datasets)."""

    kind: str
    input_shape: tuple[int, ...]
    num_classes: int


def write_config(directory, **fields):
    """A config.json of the tiny GPT-2 (``fields`` override) in ``directory``; its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.json"
    path.write_text(json.dumps({**GPT2, **fields}))
    return path


def _tokens(n=2, t=16, vocab=200):
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(0))


def test_builds_a_causal_lm_from_config_json_as_hpcnet_trains_it(tmp_path):
    model = build_model("ignored", TOKENS, {}, hf=str(write_config(tmp_path)))
    assert type(model).__name__ == "GPT2LMHeadModel" and model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.config._attn_implementation == "sdpa" and model.config.use_cache is False
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, one parameter
    logits = model(_tokens()).logits  # the token tensor, positionally
    assert logits.shape == (2, 16, 256) and logits.dtype == torch.float32
    assert [name for name, _ in find_blocks(model)] == ["transformer.h.0", "transformer.h.1"]


def test_a_llama_like_model_trains_on_tokens_the_same_way(tmp_path):
    path = write_config(tmp_path, model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = build_model("", TOKENS, {}, hf=str(path))
    assert type(model).__name__ == "LlamaForCausalLM" and model.training
    assert model(_tokens()).logits.shape == (2, 16, 256)
    assert [name for name, _ in find_blocks(model)] == ["model.layers.0", "model.layers.1"]


def test_the_same_seed_builds_the_same_weights(tmp_path):
    path = str(write_config(tmp_path))
    torch.manual_seed(3)
    a = build_model("", TOKENS, {}, hf=path)
    torch.manual_seed(3)
    b = build_model("", TOKENS, {}, hf=path)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_a_directory_with_weights_is_loaded_and_one_without_is_initialised(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    write_config(tmp_path / "cfg")
    torch.manual_seed(1)
    saved = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "cfg")).eval()
    saved.save_pretrained(tmp_path / "weights")
    torch.manual_seed(2)
    model = build_model("", TOKENS, {}, hf=str(tmp_path / "weights")).eval()
    tokens = _tokens()
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, saved(tokens).logits)
        fresh = build_model("", TOKENS, {}, hf=str(tmp_path / "cfg")).eval()
        assert not torch.equal(fresh(tokens).logits, saved(tokens).logits)
    # from_pretrained hands over an eval-mode model; hpcnet's is in training mode, as torch builds a module
    assert build_model("", TOKENS, {}, hf=str(tmp_path / "weights")).training


def test_the_dataset_kind_picks_the_head(tmp_path):
    path = str(write_config(tmp_path, pad_token_id=0))
    classifier = build_model("", Info("sequence", (16,), 5), {}, hf=path)
    assert type(classifier).__name__ == "GPT2ForSequenceClassification" and classifier.config.num_labels == 5
    assert classifier(_tokens()).logits.shape == (2, 5)
    for kind, shape in (("image", (3, 8, 8)), ("other", ())):
        with pytest.raises(ConfigError, match=rf"model.hf: no Hugging Face model head for '{kind}' data"):
            build_model("", Info(kind, shape, 3), {}, hf=path)


def test_model_options_override_config_fields_and_choose_attention_and_dtype(tmp_path):
    path = str(write_config(tmp_path))
    model = build_model("", TOKENS, {"n_layer": 3, "attn_implementation": "eager", "use_cache": True}, hf=path)
    assert len(model.transformer.h) == 3 and model.config._attn_implementation == "eager"
    assert model.config.use_cache is True
    bf16 = build_model("", TOKENS, {"dtype": "bfloat16"}, hf=path)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    with pytest.raises(ConfigError, match=r"model.options: 'n_lyer' \(did you mean 'n_layer'\?\) is no field"):
        build_model("", TOKENS, {"n_lyer": 3}, hf=path)
    with pytest.raises(ConfigError, match="model.options.dtype: 'int8' is not one of"):
        build_model("", TOKENS, {"dtype": "int8"}, hf=path)


def test_config_dtype_does_not_change_the_parameters(tmp_path):
    model = build_model("", TOKENS, {}, hf=str(write_config(tmp_path, torch_dtype="bfloat16", dtype="bfloat16")))
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def _bad(tmp_path, case):
    if case == "missing":
        return str(tmp_path / "nowhere"), TOKENS, "does not exist"
    if case == "directory without config.json":
        (tmp_path / "empty").mkdir()
        return str(tmp_path / "empty"), TOKENS, "has no config.json"
    if case == "not json":
        (tmp_path / "config.json").write_text("not json {")
        return str(tmp_path / "config.json"), TOKENS, "is not a config transformers"
    if case == "unknown model type":
        return str(write_config(tmp_path, model_type="no-such-model")), TOKENS, "is not a config transformers"
    if case == "vocabulary too small":
        return str(write_config(tmp_path, vocab_size=100)), TOKENS, "has 100 tokens, fewer than the dataset's 200"
    if case == "sequences too long":
        return str(write_config(tmp_path)), DatasetInfo("tokens", (128,), 200), "128 tokens, more than the 64"
    if case == "classifier without pad token":
        return str(write_config(tmp_path)), Info("sequence", (16,), 3), "sets no pad_token_id"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["missing", "directory without config.json", "not json", "unknown model type",
                                  "vocabulary too small", "sequences too long", "classifier without pad token"])
def test_bad_input_is_a_config_error_naming_model_hf_and_the_path(tmp_path, case):
    path, info, needle = _bad(tmp_path, case)
    with pytest.raises(ConfigError) as raised:
        build_model("", info, {}, hf=path)
    message = str(raised.value)
    assert message.startswith("model.hf") and repr(path) in message and needle in message, message
    assert "\n" not in message


def test_without_transformers_the_error_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    with pytest.raises(ConfigError, match=r"model.hf needs the transformers package: pip install 'hpcnet\[hf\]'"):
        build_model("", TOKENS, {}, hf=str(write_config(tmp_path)))


def test_hf_and_factory_together_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="model.hf and model.factory both name the model"):
        build_model("", TOKENS, {}, hf=str(write_config(tmp_path)), factory="os:getcwd")


def test_bad_options_and_damaged_weights_are_config_errors_naming_the_option(tmp_path):
    """A wrongly typed or impossible config field, and weights that do not read: one ConfigError each (status 2 in a
    run), whatever transformers, huggingface_hub or safetensors raised."""
    path = write_config(tmp_path / "cfg")
    with pytest.raises(ConfigError, match=r"model.hf: .* with model.options \{'n_layer': 'two'\}"):
        build_model("", TOKENS, {"n_layer": "two"}, hf=str(path))
    with pytest.raises(ConfigError, match=r"model.hf: .* \{'n_layer': 2.5\} .*: Validation error for field "
                                          r"'n_layer': TypeError: Field 'n_layer' expected int, got float"):
        build_model("", TOKENS, {"n_layer": 2.5}, hf=str(path))
    with pytest.raises(ConfigError, match=r"model.hf: cannot build .* \{'n_head': 0\}\): integer division"):
        build_model("", TOKENS, {"n_head": 0}, hf=str(path))
    directory = tmp_path / "damaged"
    build_model("", TOKENS, {}, hf=str(path)).save_pretrained(directory)
    (directory / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ConfigError, match="model.hf: cannot load the weights in"):
        build_model("", TOKENS, {}, hf=str(directory))


@pytest.mark.parametrize(("model_type", "options"), [
    ("gpt2", {"n_layer": -1}), ("gpt2", {"n_head": -2}), ("gpt2", {"n_embd": -4}), ("gpt2", {"n_inner": -1}),
    ("gpt2", {"n_positions": -1}), ("llama", {"num_hidden_layers": -1}), ("llama", {"intermediate_size": -8}),
    ("llama", {"num_key_value_heads": -1}), ("llama", {"head_dim": -16}),
])
def test_a_negative_size_or_count_is_refused_naming_the_option(tmp_path, model_type, options):
    """Any config's fields whose names say they size or count something (n_*, num_*, *_size, *_dim, *_heads,
    *_layers, ...) cannot be negative: a GPT-2 with n_layer=-1 would train with no layers."""
    fields = {} if model_type == "gpt2" else LLAMA
    path = str(write_config(tmp_path, **fields))
    (name, value), = options.items()
    with pytest.raises(ConfigError) as raised:
        build_model("", TOKENS, options, hf=path)
    assert str(raised.value) == (f"model.options.{name}={value}: {name} is a size or count of the {model_type} "
                                 f"config (its name says so), which cannot be negative")


def test_a_negative_size_in_config_json_is_refused_naming_the_file(tmp_path):
    path = str(write_config(tmp_path, n_layer=-1))
    with pytest.raises(ConfigError, match=rf"^model.hf: {path!r} sets n_layer=-1: n_layer is a size or count of the "
                                          r"gpt2 config \(its name says so\), which cannot be negative$"):
        build_model("", TOKENS, {}, hf=path)


def test_a_size_of_zero_that_empties_a_parameter_is_refused_naming_the_option(tmp_path):
    path = str(write_config(tmp_path))
    with pytest.raises(ConfigError, match=r"^model.options.n_inner=0 leaves the model's parameter "
                                          r"transformer.h.0.mlp.c_fc.weight with no elements \(shape \(32, 0\)\)"):
        build_model("", TOKENS, {"n_inner": 0}, hf=path)


def test_a_negative_default_of_the_config_class_is_in_the_field_s_domain(tmp_path):
    """DeBERTa's max_relative_positions defaults to -1 (no limit): its config loads; a negative layer count does
    not, nor one nested in another config (text_config)."""
    from hpcnet.models.hf import load_config

    path = str(write_config(tmp_path / "deberta", model_type="deberta", hidden_size=32, num_hidden_layers=1,
                            num_attention_heads=2, intermediate_size=64, max_position_embeddings=64))
    assert load_config(path)[0].max_relative_positions == -1
    with pytest.raises(ConfigError, match="^model.options.num_hidden_layers=-2: num_hidden_layers is a size"):
        load_config(path, {"num_hidden_layers": -2})
    nested = str(write_config(tmp_path / "llava", model_type="llava",
                              text_config={"model_type": "llama", "num_hidden_layers": -1}))
    with pytest.raises(ConfigError, match=r"sets text_config.num_hidden_layers=-1: num_hidden_layers is a size"):
        load_config(nested)


def test_negative_fields_that_are_not_sizes_and_zero_layers_still_build(tmp_path):
    """A token id of -1 (the original LLaMA's pad_token_id) is no size; zero layers leave no parameter empty."""
    path = str(write_config(tmp_path))
    assert build_model("", TOKENS, {"pad_token_id": -1}, hf=path).config.pad_token_id == -1
    assert len(build_model("", TOKENS, {"n_layer": 0}, hf=path).transformer.h) == 0


def remote_code_directory(tmp_path):
    """A model directory whose config.json names its own code (``auto_map``) for a model type transformers does
    not know; the code, if ever run, writes ``ran`` beside it."""
    directory = tmp_path / "remote"
    write_config(directory, model_type="hpcnet-remote", auto_map={"AutoConfig": "configuration_remote.RemoteConfig"})
    (directory / "configuration_remote.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(directory / 'ran')!r}).write_text('ran')\n"
        "from transformers import PretrainedConfig\n\n\n"
        "class RemoteConfig(PretrainedConfig):\n    model_type = 'hpcnet-remote'\n")
    return directory


NEVER_RUN = "hpcnet never runs a model directory's code"


def test_a_model_directory_s_own_code_is_never_run_whatever_stdin_answers(tmp_path, monkeypatch):
    """Transformers asks on stdin whether to run the code (trust_remote_code unset): a 'y' there must not run it."""
    directory = remote_code_directory(tmp_path)
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))
    with pytest.raises(ConfigError) as raised:
        build_model("", TOKENS, {}, hf=str(directory))
    assert str(raised.value).startswith(f"model.hf: {str(directory / 'config.json')!r} names code of its own "
                                        "(auto_map) for model type 'hpcnet-remote'"), raised.value
    assert NEVER_RUN in str(raised.value) and "\n" not in str(raised.value)
    assert not (directory / "ran").exists()


def test_the_planner_on_a_terminal_never_prompts_for_a_model_directory_s_code(tmp_path):
    """On a pseudo-terminal answering 'y': status 2, one line, no question asked, nothing run."""
    directory = remote_code_directory(tmp_path)
    command = [sys.executable, "-m", "hpcnet.plan", f"model.hf={directory}", "data.dataset=synthetic-tokens",
               f"data.dir={tmp_path / 'data'}"]
    status, said = run_on_terminal(command, "y\n", env=clean_env(HF_MODULES_CACHE=str(tmp_path / "modules")),
                                   cwd=tmp_path)
    assert status == 2, said
    assert "Do you wish to run the custom code" not in said and NEVER_RUN in said, said
    assert [line for line in said.splitlines() if line.strip()][-1].startswith("hpcnet.plan: error: model.hf: ")
    assert "Traceback" not in said and not (directory / "ran").exists()


def run_on_terminal(command, typed, *, env, cwd, timeout_s=120):
    """Run ``command`` with a pseudo-terminal as its stdin, stdout and stderr, ``typed`` written to it at the
    start; its status and everything it printed."""
    import os
    import pty
    import subprocess
    import time

    master, slave = pty.openpty()
    try:
        child = subprocess.Popen(command, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd,
                                 start_new_session=True)
        os.close(slave)
        os.write(master, typed.encode())
        said, deadline = b"", time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                break
            if not chunk:
                break
            said += chunk
        status = child.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        os.close(master)
    return status, said.decode(errors="replace")
