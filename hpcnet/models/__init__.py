"""Model zoo: ResNets, an MLP and a small GPT-style language model, built by name; or a Hugging Face model.

``zoo`` (the built-in models by name, ``build_model``, and ``build_from_config``: the one entry point for what a
run's ``model.*`` options name, which the trainer and the planner use); each family in its own module (``resnet``,
``mlp``, ``transformer``), the option checks in ``options``, Hugging Face transformers models (``model.hf``) in
``hf``, the blocks and their activation checkpointing in ``blocks``, the ``cuda.*`` device settings in ``device``.
"""

from hpcnet import _lazy_exports

__all__, __getattr__, __dir__ = _lazy_exports(__name__, {
    "MODELS": "zoo", "build_model": "zoo", "build_from_config": "zoo", "count_parameters": "zoo",
    "resnet_factory": "resnet",
})
