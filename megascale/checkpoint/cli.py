"""`megascale export`: a trained run as a Hugging Face model directory.

`register(subparsers)` adds the verb to the top-level parser; its handler returns the exit
code and raises UserError for the user's mistakes (one line, exit 2, nothing written).
"""

from __future__ import annotations

import argparse

_DTYPES = ("float32", "bfloat16", "float16")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export", help="write a trained run as a Hugging Face model (model.safetensors + config.json)",
        description="Write the newest checkpoint of a run (or the given checkpoint directory) as a "
                    "Hugging Face model directory that transformers' AutoModelForCausalLM.from_pretrained "
                    "loads with the same logits: GPT style as GPT-2, Llama style as Llama, Llama style with "
                    "sliding-window attention as Mistral. Models without an exact counterpart (the parallel "
                    "block, a sliding window in the GPT style, attention biases with a sliding window) are "
                    "refused.",
    )
    p.add_argument("run", metavar="RUN_DIR", help="run directory (or one checkpoint directory in it)")
    p.add_argument("--format", required=True, choices=["hf"], help="output format: hf (Hugging Face)")
    p.add_argument("--output", required=True, metavar="DIR", help="the model directory to write")
    p.add_argument("--force", action="store_true", help="replace --output if it exists and is not empty")
    p.add_argument("--dtype", default="float32", choices=_DTYPES, help="weights' dtype (default: float32)")
    p.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    from megascale.checkpoint.hf import export_run

    arch = export_run(args.run, args.output, force=args.force, dtype=args.dtype)
    print(f"wrote {args.output}: Hugging Face {arch} ({args.dtype})")
    return 0
