"""Configuration: the option tree (``options``), and loading, merging and writing it (``load``).

A run's options are one frozen ``Config`` of sections (``run``, ``model``, ``data``, ``optim``, ``train``,
``dist``, ``cuda``, ``checkpoint``, ``monitor``, ``fault``), each a dataclass whose field docstrings are the
reference (``python -m hpcnet.train --help-config`` prints them; ``docs/configuration.md`` is generated from
them). ``load_config`` merges a TOML file and ``section.option=value`` overrides onto the defaults and
validates the result; ``importing`` loads the user's objects named by import paths. Torch-free.
"""

from hpcnet.config.load import (
                                CommandLine,
                                check_same_config,
                                config_hash,
                                describe_options,
                                field_docs,
                                load_config,
                                parse_command_line,
                                parse_overrides,
                                parse_value,
                                to_dict,
                                to_toml,
)
from hpcnet.config.options import (
                                MATMUL_PRECISIONS,
                                MAX_DURATION_S,
                                MAX_SEED,
                                PRECISIONS,
                                SWITCHES,
                                CheckpointConfig,
                                Config,
                                CudaConfig,
                                DataConfig,
                                DistConfig,
                                FaultConfig,
                                ModelConfig,
                                MonitorConfig,
                                OptimConfig,
                                RunConfig,
                                TrainConfig,
)

__all__ = ["MATMUL_PRECISIONS", "MAX_DURATION_S", "MAX_SEED", "PRECISIONS", "SWITCHES", "CheckpointConfig",
           "CommandLine", "Config", "CudaConfig", "DataConfig", "DistConfig", "FaultConfig", "ModelConfig",
           "MonitorConfig", "OptimConfig", "RunConfig", "TrainConfig", "check_same_config", "config_hash",
           "describe_options", "field_docs", "load_config", "parse_command_line", "parse_overrides", "parse_value",
           "to_dict", "to_toml"]
