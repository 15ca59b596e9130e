"""A small arithmetic instruction set and a tiny random Llama to fine-tune on it (``+experiment=hf_sft_tiny``;
extra ``[hf]``)::

    python -m hydratrain.examples.arith arith      # arith/arith.jsonl and arith/tiny-llama/
    torchrun --standalone --nproc_per_node 2 train.py +experiment=hf_sft_tiny

The records are ``{"prompt": "What is 17 + 25?", "completion": "42"}`` (sums and differences of numbers below
:data:`LIMIT`), drawn by a fixed seed: the same file on every machine. The model dir is what ``save_pretrained``
writes: a Llama of :data:`LLAMA`'s sizes with random weights (seed 0), and a byte-level BPE tokenizer trained on the
records' text, with a chat template (so ``messages`` records render too) and ``<|endoftext|>`` as its end-of-text
token.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Optional, Sequence

import torch

from hydratrain.data.tokenizer import EOT, train_bpe

LIMIT = 50  # operands are below it
VOCAB = 512  # tokens of the BPE (and rows of the model's embedding)
LLAMA = dict(model_type="llama", hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, vocab_size=VOCAB)
#: a minimal chat template: each message as ``<|role|>content``, the assistant's closed by the end-of-text token
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% if m['role'] == 'assistant' %}"
                 + EOT + "{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def arith_records(n: int = 3000, seed: int = 0) -> list[dict]:
    """``n`` (at most 2 x :data:`LIMIT` ** 2) distinct questions and answers, in a fixed shuffled order."""
    questions = [(a, op, b) for a in range(LIMIT) for b in range(LIMIT) for op in "+-"]
    random.Random(seed).shuffle(questions)
    return [{"prompt": f"What is {a} {op} {b}?", "completion": str(a + b if op == "+" else a - b)}
            for a, op, b in questions[:n]]


def write_records(path: Path, records: Sequence[dict]) -> Path:
    """``records`` as JSON lines at ``path`` (its dir created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def tiny_llama(out: Path, texts: Sequence[str], config: Optional[dict] = None) -> Path:
    """A ``save_pretrained`` dir at ``out``: a random Llama of ``config`` (default :data:`LLAMA`; seed 0) and a BPE
    of its ``vocab_size`` tokens trained on ``texts``, saved as a ``transformers`` tokenizer with
    :data:`CHAT_TEMPLATE`."""
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    config = dict(config or LLAMA)
    out.mkdir(parents=True, exist_ok=True)
    train_bpe(iter(texts), config["vocab_size"], out / "tokenizer.json")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"), eos_token=EOT, bos_token=EOT)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).save_pretrained(str(out))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hydratrain.examples.arith", description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="the dir to write arith.jsonl and tiny-llama/ into")
    parser.add_argument("--records", type=int, default=3000, help="questions to write (default 3000)")
    args = parser.parse_args(argv)
    records = arith_records(args.records)
    path = write_records(args.out / "arith.jsonl", records)
    model = tiny_llama(args.out / "tiny-llama", [f"{r['prompt']} {r['completion']}" for r in records])
    print(f"wrote {len(records)} records to {path} and a tiny random Llama to {model}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
