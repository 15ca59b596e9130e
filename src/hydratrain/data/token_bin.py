"""Token files (``data=token_bin``): a flat array of token ids, uint16 or uint32, with or without llm.c's header,
opened as a read-only memmap (:func:`open_token_bin`)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from hydratrain.errors import ConfigError

# llm.c's data files (karpathy/llm.c, dev/data/data_common.py, write_datafile): a header of 256 little-endian int32
# (header[0] a magic number, header[1] a version, header[2] the token count), then the tokens. Magic 20240520 with
# version 1 is GPT-2's (uint16 tokens), magic 20240801 with version 7 is LLaMA-3's (uint32 tokens).
LLMC_HEADER_BYTES = 256 * 4
LLMC_FORMATS = {20240520: (1, "uint16"), 20240801: (7, "uint32")}  # magic -> (version, token dtype)


def llmc_header(path: Path) -> Optional[tuple[str, int]]:
    """``(token dtype, token count)`` from ``path``'s llm.c header, or None when it does not start with one.

    Raises ValueError on a known magic number with another version."""
    with open(path, "rb") as fh:
        head = fh.read(LLMC_HEADER_BYTES)
    if len(head) < LLMC_HEADER_BYTES:
        return None
    magic, version, count = (int(v) for v in np.frombuffer(head, dtype="<i4", count=3))
    if magic not in LLMC_FORMATS:
        return None
    want_version, dtype = LLMC_FORMATS[magic]
    if version != want_version:
        raise ValueError(f"llm.c header magic {magic} with version {version}; known: 20240520 v1 (uint16), "
                         f"20240801 v7 (uint32)")
    return dtype, count


def open_token_bin(path: Path, dtype: Optional[str] = None, key: str = "data.train_path") -> np.memmap:
    """``path``'s tokens as a read-only 1-D ``np.memmap`` (uint16 or uint32, little-endian); nothing is read but
    the header. An llm.c header (see :data:`LLMC_FORMATS`) is skipped and gives the dtype; without one the dtype is
    ``dtype`` (default uint16). Raises :class:`ConfigError` naming ``key`` (missing, empty or truncated file, size
    not a multiple of the dtype, unknown header version) or ``data.dtype`` (not uint16/uint32/null, or not the
    header's)."""
    path = Path(path)
    if dtype not in (None, "uint16", "uint32"):
        raise ConfigError("data.dtype", dtype, "allowed: uint16, uint32, null (the llm.c header's, else uint16)")
    if not path.is_file():
        raise ConfigError(key, str(path), "no such file")
    size = path.stat().st_size
    try:
        header = llmc_header(path)
    except ValueError as err:
        raise ConfigError(key, str(path), str(err)) from None
    offset = 0
    if header is not None:
        offset, (hdtype, count) = LLMC_HEADER_BYTES, header
        if dtype is not None and dtype != hdtype:
            raise ConfigError("data.dtype", dtype, f"{key}={path} has an llm.c header of {hdtype} tokens; "
                              f"allowed: {hdtype}, null")
        dtype = hdtype
        if size != offset + count * np.dtype(dtype).itemsize:
            raise ConfigError(key, str(path), f"its llm.c header says {count} {dtype} tokens "
                              f"({offset + count * np.dtype(dtype).itemsize} bytes) but the file has {size} bytes")
    tokens = np.dtype(dtype or "uint16").newbyteorder("<")
    if (size - offset) % tokens.itemsize:
        raise ConfigError(key, str(path), f"{size - offset} bytes of tokens is not a multiple of "
                          f"data.dtype={tokens.name}'s {tokens.itemsize}")
    if size == offset:
        raise ConfigError(key, str(path), "holds no tokens")
    return np.memmap(path, dtype=tokens, mode="r", offset=offset, shape=((size - offset) // tokens.itemsize,))
