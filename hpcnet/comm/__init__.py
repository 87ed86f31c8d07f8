"""The data plane and what decides it: ranks and nodes (``world``), the measured topology, the transport plan,
the torch.distributed bootstrap, the transports, the bucketed reducer and the data-parallel wrapper.
"""
