"""`megascale preprocess` and `megascale tokenizer train`.

`register(subparsers)` adds the verbs to the top-level parser; each sets `func` to a
handler that returns the exit code and raises UserError for the user's mistakes.
"""

from __future__ import annotations

import argparse
import sys

from megascale.errors import UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "preprocess",
        help="tokenise .txt/.jsonl[.gz]/.parquet files into an indexed dataset (<prefix>.bin/.idx)",
        description="Tokenise text into an indexed binary dataset. A .txt file is one document; a .jsonl "
                    "file holds one document per line in its \"text\" field (.jsonl.gz: the same, "
                    "gzip'd); a .parquet file one per row of its \"text\" column. Directories are "
                    "searched recursively; globs are expanded in sorted order.",
    )
    p.add_argument("--input", nargs="+", required=True, metavar="PATH", help="files, directories or globs")
    p.add_argument("--output", required=True, metavar="PREFIX", help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--tokenizer", default="byte", metavar="SPEC",
                   help='"byte", "gpt2" or a tokenizer.json path (default: byte)')
    p.add_argument("--workers", type=int, default=2, metavar="N", help="tokeniser processes (default: 2)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_preprocess)

    t = subparsers.add_parser("tokenizer", help="tokenizer tools")
    verbs = t.add_subparsers(dest="tokenizer_command", metavar="VERB", required=True)
    tt = verbs.add_parser("train", help="fit a byte-level BPE tokenizer on a corpus, write tokenizer.json",
                          description="Fit a byte-level BPE (GPT-2 style, <|endoftext|> = id 0) on the "
                                      "documents of the inputs and write a Hugging Face tokenizer.json.")
    tt.add_argument("--input", nargs="+", required=True, metavar="PATH", help="files, directories or globs")
    tt.add_argument("--output", required=True, metavar="FILE", help="the tokenizer.json to write")
    tt.add_argument("--vocab-size", type=int, required=True, metavar="N", help="vocabulary size (>= 257)")
    tt.add_argument("--no-progress", action="store_true", help="no progress bar")
    tt.set_defaults(func=_train_tokenizer)


def _preprocess(args: argparse.Namespace) -> int:
    from megascale.data.preprocessing import preprocess

    if args.workers < 1:
        raise UserError(f"--workers: must be >= 1, got {args.workers}")
    stats = preprocess(args.input, args.output, args.tokenizer, workers=args.workers,
                       progress=not args.no_progress, field="--input", output_field="--output")
    print(f"wrote {stats}", file=sys.stdout)
    return 0


def _train_tokenizer(args: argparse.Namespace) -> int:
    from megascale.data.tokenizer import train_tokenizer

    if args.vocab_size < 257:
        raise UserError(f"--vocab-size: must be at least 257 (256 bytes + <|endoftext|>), "
                        f"got {args.vocab_size}")
    tok = train_tokenizer(args.input, args.output, args.vocab_size, progress=not args.no_progress)
    print(f"wrote {args.output}: vocab {tok.vocab_size}, eos id {tok.eos_id}")
    return 0
