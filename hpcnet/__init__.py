"""hpcnet: MPI-native data-parallel training for PyTorch on HPC clusters."""

__version__ = "0.1.0"
