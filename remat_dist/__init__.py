"""remat_dist: distributed-aware activation checkpointing for PyTorch."""
