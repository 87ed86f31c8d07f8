"""The data plane and what decides it: ranks and nodes (``world``), network interfaces (``netif``), the measured
topology (``topology``, ``pingpong``), the transport plan (``plan``), the torch.distributed bootstrap, the
transports, the bucketed reducer and the data-parallel wrapper.
"""
