"""``python -m hydratrain.tokenizer``: the command-line name of :mod:`hydratrain.data.tokenizer` (train a BPE)."""
import sys

from hydratrain.data.tokenizer import main

if __name__ == "__main__":
    sys.exit(main())
