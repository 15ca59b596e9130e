"""hydratrain: Hydra-configured distributed PyTorch training (see README.md and docs/architecture.md).

Importing the package imports nothing else (no torch); ``train.py`` calls :func:`hydratrain.run.main`.
"""
__version__ = "0.2.0"
