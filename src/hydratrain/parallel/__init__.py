"""How a model is distributed and in which number formats: :mod:`.strategy` (single, ddp, fsdp; every strategy
decision), :mod:`.precision` (resolved once per run), :mod:`.wrap_policy`, :mod:`.ac_compile`, :mod:`.init`."""
