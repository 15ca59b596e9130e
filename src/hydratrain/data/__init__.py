"""The run's data (the ``data`` config group): built-in token corpora and the user's own datasets.

- :mod:`~hydratrain.data.cache`: on-disk caches of built data, built once under a lock, checked on every use.
- :mod:`~hydratrain.data.corpora`: byte-level corpora (``python_stdlib``, ``text_files``) and the synthetic stream.
- :mod:`~hydratrain.data.tokenizer`, :mod:`~hydratrain.data.tokenized`: subword tokenizers and token corpora
  (``token_bin``, ``tokenized_text``, ``python_stdlib_bpe``).
- :mod:`~hydratrain.data.streams`: token streams as fixed windows; this rank's resumable micro-batches and eval set.
- :mod:`~hydratrain.data.build`: the run's train batches and eval set for ``cfg.data``.
"""
