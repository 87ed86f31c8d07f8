"""Configuration: the option tree (``options``; its ``fault`` section in ``injection``, the bound of every duration
option in ``durations``), and loading, merging and writing it (``load``).

A run's options are one frozen ``Config`` of sections (``run``, ``model``, ``data``, ``optim``, ``train``,
``dist``, ``cuda``, ``checkpoint``, ``monitor``, ``fault``), each a dataclass whose field docstrings are the
reference (``python -m hpcnet.train --help-config`` prints them; ``docs/configuration.md`` is generated from
them). ``load_config`` merges a TOML file and ``section.option=value`` overrides onto the defaults and
validates the result; ``importing`` loads the user's objects named by import paths. Torch-free.
"""

from hpcnet import _lazy_exports

__all__, __getattr__, __dir__ = _lazy_exports(__name__, {
    **dict.fromkeys(["MATMUL_PRECISIONS", "MAX_SEED", "PRECISIONS", "SWITCHES", "CheckpointConfig", "Config",
                     "CudaConfig", "DataConfig", "DistConfig", "ModelConfig", "MonitorConfig", "OptimConfig",
                     "RunConfig", "TrainConfig"], "options"),
    "MAX_DURATION_S": "durations", "FaultConfig": "injection",
    **dict.fromkeys(["CommandLine", "check_same_config", "config_hash", "describe_options", "field_docs",
                     "load_config", "parse_command_line", "parse_overrides", "parse_value", "to_dict", "to_toml"],
                    "load"),
})
