"""The run's data (the ``data`` config group): built-in token corpora and the user's own datasets.

- :mod:`~hydratrain.data.cache`: on-disk caches of built data, built once under a lock, checked on every use.
- :mod:`~hydratrain.data.registry`: the built-in corpora (``data=<name>``), one entry each: its files, tokenizer,
  token splits, checks and the key its errors name; nothing else decides by ``data.name``.
- :mod:`~hydratrain.data.corpora`: byte-level corpora (``python_stdlib``, ``text_files``) and the synthetic stream.
- :mod:`~hydratrain.data.tokenizer`, :mod:`~hydratrain.data.token_cache`, :mod:`~hydratrain.data.token_bin`,
  :mod:`~hydratrain.data.hf_dataset`: subword tokenizers, text tokenized once into token files, pre-tokenized files,
  Hugging Face ``datasets`` files (``tokenized_text``, ``python_stdlib_bpe``, ``token_bin``, ``hf_dataset``).
- :mod:`~hydratrain.data.tokenized`: a corpus's tokenizer, the model's vocab size, the checks before the run.
- :mod:`~hydratrain.data.streams`: token streams as fixed windows; this rank's resumable micro-batches and eval set.
- :mod:`~hydratrain.data.build`: the run's train batches and eval set for ``cfg.data``.
"""
