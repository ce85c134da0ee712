"""Command line: `dflash-jax generate | convert` (and `--help` on each)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with AR, DFlash or DDTree decoding",
                       description="Generate a chat completion for each PROMPT (batched).")
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (the packaged SmolLM2-135M-Instruct GGUF), a .gguf file, an HF "
                        "safetensors directory or a converted checkpoint directory")
    p.add_argument("--method", choices=("ar", "dflash", "ddtree"), default="ar")
    p.add_argument("--draft", help="DFlash drafter directory (config.json + model.safetensors)")
    p.add_argument("--block-size", type=int, default=None, help="drafter block size (default: drafter's)")
    p.add_argument("--budget", type=int, default=64, help="DDTree node budget")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="weight dtype (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--no-chat", action="store_true", help="do not wrap prompts in the chat template")
    p.add_argument("--json", action="store_true", help="print a JSON record instead of text")


def _add_convert(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="convert HF safetensors / GGUF weights to a fast-loading checkpoint",
                       description="Convert SRC (HF directory, .safetensors, .gguf or 'smollm2') to an "
                                   "orbax checkpoint directory DST.")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_convert(sub)
    return parser


def _default_dtype() -> str:
    import jax
    return "bfloat16" if jax.default_backend() == "gpu" else "float32"


def cmd_generate(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from convert import load_model
    from dflash_jax import pipeline
    from dflash_jax.sampling import SamplingParams

    dtype = jnp.dtype(args.dtype or _default_dtype())
    cfg, params, tokenizer = load_model(args.model, dtype=dtype)
    if tokenizer is None:
        raise SystemExit(f"--model {args.model}: no tokenizer found beside the weights")
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    token_lists = pipeline.encode_prompts(tokenizer, args.prompts, chat=not args.no_chat)
    prompts, lens = pipeline.pad_prompts(token_lists)
    stop = pipeline.stop_tokens_for(tokenizer, cfg)
    if args.method == "ar":
        run = pipeline.run_ar(params, cfg, prompts, lens, max_new_tokens=args.max_new_tokens,
                              sampling=sampling, stop_tokens=stop, seed=args.seed)
    else:
        from convert.dflash_drafter import load_drafter
        from dflash_jax.drafter import validate_pair
        from dflash_jax.speculative import SpecSettings

        if not args.draft:
            raise SystemExit(f"--method {args.method} needs --draft PATH (a DFlash drafter directory)")
        dcfg, dparams = load_drafter(args.draft, dtype=dtype)
        validate_pair(dcfg, cfg)
        settings = SpecSettings(method=args.method, block_size=args.block_size or dcfg.block_size,
                                budget=args.budget, sampling=sampling, max_new_tokens=args.max_new_tokens,
                                stop_tokens=stop)
        run = pipeline.run_speculative(params, cfg, dparams, dcfg, prompts, lens, settings, seed=args.seed)
    texts = [tokenizer.decode(t, skip_special_tokens=True) for t in run.token_lists()]
    record = {"method": args.method, "texts": texts, "tokens": run.total_tokens,
              "seconds": run.seconds, "compile_seconds": run.compile_seconds,
              "tokens_per_second": run.tokens_per_second, "acceptance": run.acceptance()}
    if args.json:
        print(json.dumps(record))
        return 0
    for prompt, text in zip(args.prompts, texts):
        print(f">>> {prompt}\n{text}\n")
    acc = record["acceptance"]
    tau = f", tau {acc['tau']:.2f}" if acc else ""
    print(f"[{args.method}] {run.total_tokens} tokens in {run.seconds:.2f} s: "
          f"{run.tokens_per_second:.1f} tokens/s (compile {run.compile_seconds:.1f} s excluded{tau})")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from convert import convert_command
    convert_command(args.src, args.dst, dtype=jnp.dtype(args.dtype))
    print(f"wrote {args.dst}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"generate": cmd_generate, "convert": cmd_convert}[args.command](args)
    except (ValueError, FileNotFoundError) as err:
        print(f"dflash-jax {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
