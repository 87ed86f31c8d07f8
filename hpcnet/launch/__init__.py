"""The supervisor (``python -m hpcnet.launch``): restarts an attempt after a restartable failure, torch-free.
"""
