"""hydratrain's Hydra launcher plugin: ``hydra/launcher=torchrun`` (selected by the ``launcher=torchrun`` preset)."""
