"""``python -m hydratrain.export CHECKPOINT_DIR OUT.safetensors``: the command of
:mod:`hydratrain.checkpoint.export`."""
from hydratrain.checkpoint.export import export, main

__all__ = ["export", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
