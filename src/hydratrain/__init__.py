"""hydratrain: Hydra-configured distributed PyTorch training (see README.md and docs/architecture.md).

Importing the package imports nothing else (no torch); ``train.py`` calls :func:`hydratrain.run.main`.
"""
import logging

__version__ = "0.2.0"

# A library's logger: with no handler configured anywhere (hydra/job_logging=disabled) its records are dropped, not
# echoed by logging's "last resort" handler (hydratrain's one-line errors are printed anyway).
logging.getLogger(__name__).addHandler(logging.NullHandler())
