"""``python -m hydratrain.tokenizer``: train a byte-level BPE tokenizer (:mod:`hydratrain.data.tokenizer`) on text
files."""
import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from hydratrain.data.corpora import expand_paths
from hydratrain.data.token_cache import segment_texts, split_segments
from hydratrain.data.tokenizer import train_bpe
from hydratrain.paths import prepare_output_file


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m hydratrain.tokenizer train --vocab-size N [--out DIR|FILE.json] [--val-fraction F] FILES...``.

    Trains a byte-level BPE on the training split of the files (split by file as ``data.val_fraction`` does),
    writes ``DIR/tokenizer.json`` (or ``FILE.json``) and prints its path. Exit status 2 on a bad argument, a glob
    matching nothing or an ``--out`` that cannot be written, each found before the training.
    """
    parser = argparse.ArgumentParser(prog="python -m hydratrain.tokenizer",
                                     description="Train a byte-level BPE tokenizer (Hugging Face tokenizers).")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a byte-level BPE on text files")
    train.add_argument("--vocab-size", type=int, required=True, help="tokens, >= 257 (e.g. 4096, 32768)")
    train.add_argument("--out", default="tokenizer", help="dir to write tokenizer.json into (default: ./tokenizer), "
                       "or a file name ending in .json")
    train.add_argument("--val-fraction", type=float, default=0.05,
                       help="share of files held out as data.val_fraction does (default 0.05; 0 = train on all)")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.add_argument("files", nargs="+", help="files or globs (** allowed), relative to the current dir")
    args = parser.parse_args(argv)
    if args.vocab_size < 257:
        parser.error(f"--vocab-size {args.vocab_size}: a byte-level BPE needs >= 257")
    if not 0.0 <= args.val_fraction < 1.0:
        parser.error(f"--val-fraction {args.val_fraction}: must be in [0, 1)")
    try:
        files = expand_paths(args.files, Path.cwd())
    except FileNotFoundError as err:
        parser.error(str(err).replace("data.paths: ", ""))
    out = Path(args.out) if args.out.endswith(".json") else Path(args.out) / "tokenizer.json"
    try:  # before the training, which can take minutes
        prepare_output_file(out)
    except OSError as err:
        parser.error(f"--out {args.out}: cannot write {out} ({err.strerror}: {err.filename})")
    root = Path(os.path.commonpath([str(f.parent) for f in files]))
    train_part = split_segments(files, root, args.val_fraction)["train"] if args.val_fraction > 0 else [
        (f, 0, None) for f in files]
    texts = segment_texts(train_part)
    tok = train_bpe(texts, args.vocab_size, out, progress=not args.quiet)
    print(f"wrote {out.resolve()} ({tok.vocab_size} tokens, trained on {len(train_part)} of {len(files)} file(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
