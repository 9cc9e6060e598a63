"""Tensor parallelism on torch.distributed: one model over several processes, GPUs or machines
(group.py: the ranks and their collectives; sharding.py: each rank's part of the model;
workers.py: starting the ranks)."""
