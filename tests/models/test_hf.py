"""hpcnet.models.hf: ``model.hf`` builds a Hugging Face transformers model from a local config or directory."""

import json
import sys
from dataclasses import dataclass

import pytest
import torch

from hpcnet.data.info import DatasetInfo
from hpcnet.errors import ConfigError
from hpcnet.models import build_model
from hpcnet.models.blocks import find_blocks

pytest.importorskip("transformers")

GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 256, "n_positions": 64,
        "bos_token_id": 0, "eos_token_id": 0}
"""A tiny GPT-2: 2 layers of width 32, vocabulary 256, 64 positions."""
TOKENS = DatasetInfo("tokens", (16,), 200)


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
    with pytest.raises(ConfigError, match=r"model.hf: cannot build .* \{'n_embd': -4\}\): Trying to create"):
        build_model("", TOKENS, {"n_embd": -4}, hf=str(path))
    directory = tmp_path / "damaged"
    build_model("", TOKENS, {}, hf=str(path)).save_pretrained(directory)
    (directory / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ConfigError, match="model.hf: cannot load the weights in"):
        build_model("", TOKENS, {}, hf=str(directory))
