"""Sharded checkpoints: the manager that saves a dict of Stateful components (:mod:`.manager`), preemption by
signal (:mod:`.preemption`), safe reading (:mod:`.io`) and full-weight export (:mod:`.export`)."""
