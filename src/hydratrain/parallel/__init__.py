"""How a model is distributed and in which number formats: :mod:`.strategy` (the interface, single, ddp; every
strategy decision), :mod:`.fsdp` (fsdp, hsdp), :mod:`.build` (the strategy from the config, the model under it),
:mod:`.precision` (resolved once per run), :mod:`.wrap_policy`, :mod:`.ac_compile`, :mod:`.init`."""
