"""Sharded checkpoints: the manager that saves a dict of Stateful components (:mod:`.manager`), preemption by
signal (:mod:`.preemption`), safe reading (:mod:`.io`) and full-weight export (:mod:`.export`)."""

# DCP writes this file last: a checkpoint dir holding it is complete. Defined here, not in .io, so that listing and
# finding checkpoints does not import torch.distributed.checkpoint (about 1 s of start-up).
METADATA = ".metadata"
