"""Command line: `dflash-jax generate | convert | make-prompts | make-data | train | bench | compare | decode`
(and `--help` on each)."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from dflash_jax.files import atomic_write_text, check_writable, stuck_threads


# ----------------------------------------------------------------------------- argument types
# Numbers are checked as they are parsed, so a bad one is refused before any model is loaded:
# a NaN temperature, a zero block size or a negative learning rate otherwise pass through to
# a ZeroDivisionError or to garbage output.

def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    parse.__name__ = f"int >= {low}"
    return parse


def _float_in(low: float, high: float = math.inf, low_open: bool = False, high_open: bool = False
              ) -> Callable[[str], float]:
    """A finite float in [low, high] (either end open when asked)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        too_low = value <= low if low_open else value < low
        too_high = value >= high if high_open else value > high
        if not math.isfinite(value) or too_low or too_high:
            left, right = "(" if low_open else "[", ")" if high_open or high == math.inf else "]"
            raise argparse.ArgumentTypeError(f"must be a finite number in {left}{low:g}, {high:g}{right}, got {text}")
        return value
    parse.__name__ = "number"
    return parse


POSITIVE = _int_at_least(1)
NON_NEGATIVE = _int_at_least(0)
BLOCK_SIZE = _int_at_least(2)  # a block is the root and at least one drafted token
TEMPERATURE = _float_in(0.0)
POSITIVE_FLOAT = _float_in(0.0, low_open=True)
FRACTION = _float_in(0.0, 1.0)


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, exit code 2 (argparse's own prints the usage block first)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

# transformers serves only tokenizers here; without torch it would warn, on every command, that
# its PyTorch models are unavailable.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with AR, DFlash, DDTree or MTP decoding",
                       description="Generate a chat completion for each PROMPT (batched).")
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (the packaged SmolLM2-135M-Instruct GGUF), a .gguf file, an HF "
                        "safetensors directory or a converted checkpoint directory")
    p.add_argument("--method", choices=("ar", "dflash", "ddtree", "mtp"), default="ar")
    p.add_argument("--draft", help="DFlash drafter directory (config.json + model.safetensors), "
                                   "or 'smollm2' for the drafter shipped with dflash-jax; for --method mtp the "
                                   "MTP head: a checkpoint with mtp.* tensors, or 'smollm2' for the head shipped "
                                   "for it (default: --model itself)")
    p.add_argument("--mtp-steps", type=POSITIVE, default=3, help="mtp: chained head steps per round")
    p.add_argument("--stage-times", action="store_true",
                   help="dflash/ddtree: also run the rounds stage by stage (each stage its own jitted "
                        "program) and print the median ms per stage; a hybrid target's verify also split "
                        "into its attention, GDN and other layers' work (by a profile of the verify)")
    p.add_argument("--compare-ar", action="store_true",
                   help="also decode with plain AR: print the speedup and whether the tokens agree")
    p.add_argument("--block-size", type=BLOCK_SIZE, default=None, help="drafter block size (default: drafter's)")
    p.add_argument("--budget", type=POSITIVE, default=64, help="DDTree node budget")
    p.add_argument("--mtp-budget", type=NON_NEGATIVE, default=0,
                   help="mtp: tree nodes per round (0: verify the steps as a chain)")
    p.add_argument("--max-new-tokens", type=POSITIVE, default=128)
    p.add_argument("--rounds-per-check", type=POSITIVE, default=1,
                   help="dflash/ddtree: rounds between two reads of whether every sequence is done")
    p.add_argument("--temperature", type=TEMPERATURE, default=0.0)
    p.add_argument("--top-k", type=NON_NEGATIVE, default=0)
    p.add_argument("--top-p", type=_float_in(0.0, 1.0, low_open=True), default=1.0)
    p.add_argument("--seed", type=NON_NEGATIVE, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="weight dtype (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--no-chat", action="store_true", help="do not wrap prompts in the chat template")
    p.add_argument("--json", action="store_true", help="print a JSON record instead of text")
    p.add_argument("--quiet", action="store_true",
                   help="no progress on stderr (it is shown only when stderr is a terminal)")
    p.add_argument("--tp", type=POSITIVE, default=1, help="tensor-parallel devices (must divide the q heads)")
    p.add_argument("--dp", type=POSITIVE, default=1, help="data-parallel devices (the batch is split over them)")


def _add_convert(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="convert HF safetensors / GGUF weights to a fast-loading checkpoint",
                       description="Convert SRC (HF directory, .safetensors, .gguf or 'smollm2') to an "
                                   "orbax checkpoint directory DST.")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--overwrite", action="store_true",
                   help="replace DST if it is a dflash-jax checkpoint (never another directory)")


# Commands that run as one program over many processes (`dflash_jax.distributed`).
MULTI_PROCESS = ("make-data", "make-taps", "train", "decode")


def _add_distributed(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="multi-process run: the address of process 0, the same on every host, or 'auto' "
                        "(jax detects Slurm / Open MPI / TPU); default $JAX_COORDINATOR_ADDRESS")
    p.add_argument("--num-processes", type=POSITIVE, default=None, metavar="N",
                   help="processes in the run (default $JAX_NUM_PROCESSES)")
    p.add_argument("--process-id", type=NON_NEGATIVE, default=None, metavar="I",
                   help="this process, 0..N-1; process 0 writes every output (default $JAX_PROCESS_ID)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dflash-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_convert(sub)
    _add_make_prompts(sub)
    _add_make_data(sub)
    _add_make_taps(sub)
    _add_train(sub)
    _add_bench(sub)
    _add_compare(sub)
    _add_decode(sub)
    for name in MULTI_PROCESS:
        _add_distributed(sub.choices[name])
    for p in sub.choices.values():
        p.add_argument("--debug", action="store_true",
                       help="show the traceback of an error instead of its one-line message")
        p.add_argument("--no-weight-check", action="store_true",
                       help="skip the check that every loaded weight is finite (one pass over the weights)")
    return parser


def _default_dtype() -> str:
    import jax
    return "bfloat16" if jax.default_backend() == "gpu" else "float32"


def _load_target(name: str, dtype: Any, flag: str = "--model", **kwargs: Any) -> tuple[Any, Any, Any]:
    """(cfg, params, tokenizer) of a target, the params in the decoding layout; every command
    that decodes text needs the tokenizer."""
    from convert import load_model

    cfg, params, tokenizer = load_model(name, dtype=dtype, **kwargs)
    if tokenizer is None:
        raise ValueError(f"{flag} {name}: no tokenizer found beside the weights")
    return cfg, params, tokenizer


def _load_drafter_for(path: str, cfg: Any, dtype: Any, mesh: Any = None) -> tuple[Any, Any]:
    """(dcfg, dparams) of a drafter (`--draft`: a directory or a shipped name) in the decoding
    layout, checked against the target's config."""
    from convert.dflash_drafter import load_drafter
    from convert.shipped import DFLASH, resolve_shipped
    from dflash_jax.drafter import validate_pair

    dcfg, dparams = load_drafter(resolve_shipped(path, DFLASH, "--draft"), dtype=dtype, mesh=mesh)
    validate_pair(dcfg, cfg)
    return dcfg, dparams


def _mtp_head_source(path: str | None, model: str, flag: str = "--draft") -> Path:
    """Where the MTP head's `mtp.*` tensors are: `path` (given as `flag`) or the target checkpoint
    `model`. The commands check it before the target loads, so that a wrong path costs no load."""
    from convert import resolve_source
    from convert.hf_safetensors import checkpoint_files, open_safetensors
    from convert.mtp import PREFIX
    from convert.shipped import MTP, resolve_shipped

    given, name = (resolve_shipped(path, MTP, flag), flag) if path else (model, "--model")
    try:
        kind, where = resolve_source(given)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None
    if kind != "hf":
        raise ValueError(f"{name} {given}: an MTP head is read from safetensors mtp.* tensors (a Qwen3.5 / Qwen3.6 "
                         "checkpoint, or a directory written by convert.mtp.export_mtp), not from a "
                         f"{kind} {'file' if kind == 'gguf' else 'directory'}")
    # Headers only: a checkpoint without any head tensor is named now, not after the target loads
    # (`load_mtp` names a missing one of a head that is there).
    files, source = checkpoint_files(where)
    for file in files:
        with open_safetensors(file) as f:
            if any(key.startswith(PREFIX) for key in f.keys()):
                return where
    raise ValueError(f"{name} {given}: {source} holds no {PREFIX}* tensors, so no MTP head"
                     + ("" if path else f"; pass {flag} with a head (train --drafter-kind mtp exports one)"))


def _load_mtp_head_for(path: str | None, model: str, cfg: Any, dtype: Any, flag: str = "--draft",
                       mesh: Any = None) -> tuple[Any, Any]:
    """(MTPConfig, MTPParams) of the head in `path` (default: the target checkpoint `model`), on
    its tensor-parallel shards under a mesh."""
    from convert.mtp import hidden_source_of, load_mtp
    from dflash_jax.mtp import MTPConfig

    where = _mtp_head_source(path, model, flag)
    return MTPConfig(cfg, hidden_source=hidden_source_of(where)), load_mtp(where, cfg, dtype, mesh=mesh)


def ar_verdict(same_tokens: bool, temperature: float, dtype: Any) -> str:
    """generate --compare-ar's last words: whether the run gave AR's tokens, and what a difference means."""
    import jax.numpy as jnp

    if same_tokens:
        return "the same tokens as ar (lossless)"
    if temperature > 0:
        return "tokens DIFFER from ar (sampling)"
    if jnp.dtype(dtype) != jnp.float32:
        # Greedy output in a narrow dtype can part from AR's at a near-tie: the verify reads those
        # logits through kernels of other shapes. float32 is the exact comparison (BUILD.md).
        return (f"tokens DIFFER from ar: in {jnp.dtype(dtype).name}, greedy output can part at a near-tie; "
                "--dtype float32 compares exactly")
    return "tokens DIFFER from ar"


def cmd_generate(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from dflash_jax import pipeline
    from dflash_jax import sharding as sh
    from dflash_jax.sampling import SamplingParams

    if args.method not in ("ar", "mtp") and not args.draft:
        raise ValueError(f"--method {args.method} needs --draft PATH (a DFlash drafter directory)")
    if args.stage_times and args.method == "mtp":
        raise ValueError("--stage-times times a DFlash drafter's stages: use it with --method dflash or ddtree "
                         "(an MTP round is timed whole: python -m dflash_jax.bench.spec_round --mtp-steps)")
    if args.stage_times and args.method == "ar":
        raise ValueError("--stage-times times the stages of a speculative round: "
                         "use it with --method dflash or ddtree")
    if args.budget < 1:
        raise ValueError(f"--budget must be >= 1, got {args.budget}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.method == "mtp":
        _mtp_head_source(args.draft, args.model, "--draft")  # before the target loads
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    dtype = jnp.dtype(args.dtype or _default_dtype())
    mesh = sh.make_mesh(args.dp, args.tp) if args.dp * args.tp > 1 else None
    spec = args.method != "ar"
    compare = args.compare_ar and spec
    hybrid = _is_hybrid(args.model)
    progress = _Stages(1 + spec + 2 * (1 + compare) + bool(args.stage_times), args.quiet)
    progress.begin(f"loading {args.model}")
    cfg, params, tokenizer = _load_target(args.model, dtype, mesh=mesh)
    token_lists = pipeline.encode_prompts(tokenizer, args.prompts, chat=not args.no_chat)
    token_lists += [token_lists[-1]] * (-len(token_lists) % args.dp)  # dp splits the batch evenly
    prompts, lens = pipeline.pad_prompts(token_lists)
    stop = pipeline.stop_tokens_for(tokenizer, cfg)
    stages = None
    # A hybrid decodes AR with its own loop (`qwen3_5.generate`); its speculative rounds share
    # `pipeline.run_speculative` with dense targets (`speculative.target_family` picks by the config).
    run_ar = _run_hybrid_ar if hybrid else pipeline.run_ar
    with sh.use_mesh(mesh):  # traced and compiled sharded over the mesh (no-op without one)
        if args.method == "ar":
            run = run_ar(params, cfg, prompts, lens, max_new_tokens=args.max_new_tokens, sampling=sampling,
                         stop_tokens=stop, seed=args.seed, stage=progress.of("ar"))
        else:
            from dflash_jax.impl import Impl
            from dflash_jax.speculative import SpecSettings

            if args.method == "mtp":
                progress.begin(f"loading the MTP head of {args.draft or args.model}")
                dcfg, dparams = _load_mtp_head_for(args.draft, args.model, cfg, dtype, "--draft", mesh)
                settings = SpecSettings(method="mtp", mtp_steps=args.mtp_steps, budget=args.mtp_budget,
                                        sampling=sampling, max_new_tokens=args.max_new_tokens, stop_tokens=stop)
            else:
                progress.begin(f"loading drafter {args.draft}")
                dcfg, dparams = _load_drafter_for(args.draft, cfg, dtype, mesh)
                settings = SpecSettings(method=args.method, block_size=args.block_size or dcfg.block_size,
                                        budget=args.budget, sampling=sampling, max_new_tokens=args.max_new_tokens,
                                        stop_tokens=stop)
            impl = Impl(rounds_per_check=args.rounds_per_check)
            run = pipeline.run_speculative(params, cfg, dparams, dcfg, prompts, lens, settings,
                                           seed=args.seed, impl=impl, stage=progress.of(args.method))
            if args.stage_times:
                progress.begin("timing each stage of a round")
                import jax

                from dflash_jax.stage_times import time_stages
                stages = time_stages(params, cfg, dparams, dcfg, jnp.asarray(prompts), jnp.asarray(lens),
                                     jax.random.key(args.seed), settings=settings, impl=impl,
                                     max_len=pipeline.default_max_len(prompts.shape[1], args.max_new_tokens,
                                                                      settings.cache_slack()))
        ar = None
        if compare:
            ar = run_ar(params, cfg, prompts, lens, max_new_tokens=args.max_new_tokens, sampling=sampling,
                        stop_tokens=stop, seed=args.seed, stage=progress.of("ar"))
    progress.close()
    texts = [tokenizer.decode(t, skip_special_tokens=True) for t in run.token_lists()[:len(args.prompts)]]
    record = {"method": args.method, "texts": texts, "tokens": run.total_tokens,
              "seconds": run.seconds, "compile_seconds": run.compile_seconds,
              "tokens_per_second": run.tokens_per_second, "acceptance": run.acceptance()}
    if ar is not None:
        record["ar"] = {"tokens": ar.total_tokens, "seconds": ar.seconds, "compile_seconds": ar.compile_seconds,
                        "tokens_per_second": ar.tokens_per_second, "speedup": run.tokens_per_second / ar.tokens_per_second,
                        "same_tokens": run.token_lists() == ar.token_lists()}
    if stages is not None:
        record["stage_ms"] = {**stages.ms, **{f"verify/{k}": v for k, v in stages.verify_parts.items()},
                              "rounds_timed": stages.rounds}
    if args.json:
        print(json.dumps(record))
        return 0
    for prompt, text in zip(args.prompts, texts):
        print(f">>> {prompt}\n{text}\n")
    acc = record["acceptance"]
    # tau: tokens committed per target forward (one round), the bonus token included.
    tau = f", tau {acc['tau']:.2f} tokens per round" if acc else ""
    width = len(args.method) + 1
    print(f"{args.method + ':':<{width}} {run.total_tokens} tokens in {run.seconds:.2f} s = "
          f"{run.tokens_per_second:.1f} tokens/s{tau} (compiling, {run.compile_seconds:.1f} s, not counted)")
    if stages is not None and stages.rounds:
        print(stages.summary())
    if ar is not None:
        a = record["ar"]
        same = ar_verdict(a["same_tokens"], args.temperature, dtype)
        print(f"{'ar:':<{width}} {a['tokens']} tokens in {a['seconds']:.2f} s = {a['tokens_per_second']:.1f} "
              f"tokens/s (compiling, {a['compile_seconds']:.1f} s, not counted)")
        print(f"{args.method} is {a['speedup']:.2f}x as fast as ar; {same}")
    return 0


def _is_hybrid(model: str) -> bool:
    """Whether --model names a Qwen3.5 / Qwen3.6 hybrid checkpoint (read from its config.json only)."""
    from convert import is_qwen35, resolve_source

    kind, path = resolve_source(model)
    return kind == "hf" and is_qwen35(path)


def _run_hybrid_ar(params: Any, cfg: Any, prompts: Any, lens: Any, *, max_new_tokens: int, sampling: Any,
                   stop_tokens: tuple[int, ...], seed: int, stage: Any) -> Any:
    """AR decoding of a Qwen3.5 / Qwen3.6 hybrid (`qwen3_5.generate`), timed as `pipeline.run_ar` times
    a dense target's; prompts [B, P] right-padded, lens [B]."""
    import jax
    import jax.numpy as jnp

    from dflash_jax import pipeline
    from dflash_jax import qwen3_5 as q35
    from dflash_jax.generate import Generation, check_prompts

    max_len = pipeline.default_max_len(prompts.shape[1], max_new_tokens, 1)
    check_prompts(lens, prompts.shape[1], max_new_tokens, max_len)
    timed = pipeline.timed_call(q35.generate, params, cfg, jnp.asarray(prompts), jnp.asarray(lens),
                                jax.random.key(seed), max_new_tokens=max_new_tokens, max_len=max_len,
                                sampling=sampling, stop_tokens=stop_tokens, stage=stage)
    tokens, num_tokens = timed.generation
    return pipeline.TimedGeneration(Generation(tokens, num_tokens), timed.seconds, timed.compile_seconds)


class _Stages:
    """generate's progress on stderr: the stage running (loading, compiling, decoding), how many
    are done and the time so far, redrawn every second. Hidden with --quiet and when stderr is not
    a terminal, so stdout carries only the answers."""

    def __init__(self, total: int, quiet: bool) -> None:
        import threading

        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="starting", file=sys.stderr, disable=True if quiet else None,
                        leave=False, bar_format="{desc} ({n}/{total} stages done, {elapsed})")
        self.running = False
        self.done = threading.Event()
        if not self.bar.disable:
            # Compiling takes seconds without a callback; the clock shows it is still at work.
            threading.Thread(target=self._tick, daemon=True).start()

    def _tick(self) -> None:
        while not self.done.wait(1.0):
            self.bar.refresh()

    def begin(self, what: str) -> None:
        if self.running:
            self.bar.update()
        self.running = True
        self.bar.set_description_str(what)

    def of(self, method: str) -> Any:
        """The `stage` callback of `pipeline.run_ar` / `run_speculative` for this method."""
        return lambda stage: self.begin(f"{'compiling' if stage == 'compile' else 'decoding'} {method}")

    def close(self) -> None:
        self.done.set()
        if self.running:
            self.bar.update()
        self.bar.close()


def cmd_convert(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from convert import convert_command
    convert_command(args.src, args.dst, dtype=jnp.dtype(args.dtype), overwrite=args.overwrite)
    print(f"wrote {args.dst}")
    return 0


# ----------------------------------------------------------------------------- training and benchmarks
# `make-data`, `train` and `bench` (issue 5); the work is done in dflash_jax.train_data,
# dflash_jax.train and dflash_jax.evaluate.

_DATA_DIR = "../shared/data"


def _add_data_gen_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", nargs="+", metavar="JSONL[:N]", default=None,
                   help="training prompt files, FILE:N for the first N rows of one (default: gsm8k train + "
                        "alpaca_eval under --data-dir); evaluation sets (spec_bench, test splits, held-out "
                        "code) are refused")
    p.add_argument("--data-dir", default=_DATA_DIR, help="the shared prompt sets (default: %(default)s)")
    p.add_argument("--limit", type=POSITIVE, default=None, help="prompts read per file (default: all)")
    p.add_argument("--gen-tokens", type=POSITIVE, default=256, help="max new tokens per response")
    p.add_argument("--max-prompt-tokens", type=POSITIVE, default=256, help="skip longer templated prompts")
    p.add_argument("--gen-batch", type=POSITIVE, default=32, help="prompts decoded together")
    p.add_argument("--sample-fraction", type=FRACTION, default=0.5,
                   help="fraction of batches sampled at --gen-temperature (the rest greedy)")
    p.add_argument("--gen-temperature", type=TEMPERATURE, default=1.0)
    p.add_argument("--math-suffix", choices=("auto", "always", "never"), default="auto",
                   help="append evaluation's step-by-step / \\boxed{} instruction to math prompts (auto: "
                        "gsm8k-style rows), so responses match what `bench` prompts get (default: %(default)s)")
    p.add_argument("--samples-per-prompt", type=POSITIVE, default=1,
                   help="responses per prompt: the first follows --sample-fraction, the others are sampled "
                        "at --gen-temperature, each with its own seed (default: %(default)s)")


def _add_make_prompts(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-prompts", help="build the offline prompt sets (stdlib code tasks, seed topics, "
                                            "long-context tasks)",
                       description="Write prompt files (JSONL) into OUT: code-stdlib = tasks from the "
                                   "Python standard library's functions (code_stdlib_train.jsonl for training, "
                                   "code_heldout.jsonl for evaluation, split by module); code-topics = "
                                   "programming tasks the target writes and solves from seed topics "
                                   "(code_topics.jsonl); context = summarisation, question and extraction "
                                   "prompts over passages of the standard library's prose (context_tasks.jsonl, "
                                   "300-1000 tokens each: make-data needs --max-prompt-tokens above 256 for "
                                   "them); seeds = prompts that ask the target to write chat prompts and German "
                                   "passages (seed_tasks.jsonl), for `decode`. With --answers (that decode's "
                                   "output) it writes the target's prompts as derived_tasks.jsonl: its chat "
                                   "prompts, and its German as 'Translate German to English' prompts. Prints "
                                   "the row counts (also OUT/prompt_sets.json).")
    p.add_argument("sets", nargs="*", metavar="SET",
                   help="some of code-stdlib, code-topics, context, seeds (default: all; none with --answers)")
    p.add_argument("--answers", metavar="FILE",
                   help="a `decode` output of seed_tasks.jsonl: write derived_tasks.jsonl from it")
    p.add_argument("--out", required=True, help="directory for the prompt files")


def _add_make_data(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-data", help="let the target answer training prompts; write a token file",
                       description="Wrap training prompts in the target's chat template, generate the "
                                   "target's responses (greedy / T=1 mix) and save prompt + response "
                                   "tokens to OUT (.npz).")
    p.add_argument("--target", default="smollm2", help="target model (as `generate --model`)")
    p.add_argument("--out", required=True, help="token file to write (.npz)")
    p.add_argument("--seed", type=NON_NEGATIVE, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    _add_data_gen_args(p)


def _add_make_taps(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-taps", help="write the target's tap features of a token file once, for train --taps",
                       description="Run the target over every training row of DATA (cut to --seq-len as train "
                                   "cuts them) and write its tap features to OUT (taps.bin + taps.json), for "
                                   "`train --taps OUT`: training then never runs the target.")
    p.add_argument("--target", default="smollm2", help="target model (as `generate --model`)")
    p.add_argument("--data", required=True, help="token file from make-data")
    p.add_argument("--out", required=True, help="taps directory")
    p.add_argument("--seq-len", type=_int_at_least(2), required=True, help="tokens per row: train's --seq-len")
    p.add_argument("--layers", type=POSITIVE, default=3,
                   help="drafter layers: one default tap each (default 3); an MTP head (train --drafter-kind mtp) "
                        "trains on the target's last layer: --tap-layers N-1 for N layers")
    p.add_argument("--tap-layers", type=NON_NEGATIVE, nargs="+", default=None,
                   help="the drafter's target_layer_ids instead of --layers' defaults")
    p.add_argument("--batch", type=POSITIVE, default=8, help="rows per target forward")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="of the stored taps and the forward: train's --compute-dtype")
    p.add_argument("--no-progress", action="store_true")


def cmd_make_taps(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp

    from convert import load_model
    from dflash_jax import train as tr
    from dflash_jax.config import default_tap_layers
    from dflash_jax.train_data import TokenData, build_sequences

    check_writable(Path(args.out).absolute().parent, "--out")
    data = TokenData.load(args.data)
    dtype = args.dtype or _default_dtype()
    # Loaded straight in the taps' dtype, as `train` loads its frozen target: the same rounding as
    # a float32 load cast afterwards, without the float32 copy (a 27B target is 108 GB in float32,
    # and its bf16 cast beside it would not fit one 141 GB H200). No tokenizer: tokens are given.
    cfg, params, _ = load_model(args.target, dtype=jnp.dtype(dtype), tokenizer=False)
    taps = tuple(args.tap_layers) if args.tap_layers else tuple(default_tap_layers(cfg.num_layers, args.layers))
    bad = [t for t in taps if t >= cfg.num_layers]
    if bad:
        raise ValueError(f"--tap-layers {bad}: the target has layers 0..{cfg.num_layers - 1}")
    seqs = build_sequences(data, args.seq_len)
    store = tr.write_taps(params, cfg, seqs, taps, args.out, batch_size=args.batch,
                          dtype=dtype, progress=not args.no_progress)
    if jax.process_index() == 0:
        print(json.dumps({"out": str(store.path), "rows": store.rows, "seq_len": store.seq_len, "tap_layers": list(taps),
                          "dtype": store.dtype, "gb": store.rows * store.seq_len * store.features
                          * jnp.dtype(store.dtype).itemsize / 1e9}))
    return 0


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a DFlash drafter (or an MTP head) for a target",
                       description="Train a DFlash block-diffusion drafter (DFlash recipe: random anchors, "
                                   "packed blocks, decayed block loss, AdamW + cosine). Writes checkpoints, "
                                   "log.jsonl, plots/ and the z-lab export drafter/ under OUT. With "
                                   "--drafter-kind mtp, an MTP head (next-next-token prediction from the "
                                   "target's last state) with the same data and schedule, exported to OUT/mtp/.")
    p.add_argument("--target", default="smollm2", help="target model (as `generate --model`)")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--data", default=None, help="token file from make-data (default: OUT/train_tokens.npz)")
    p.add_argument("--data-gen", action="store_true", help="generate the token file first if it is missing")
    p.add_argument("--taps", default=None, metavar="DIR",
                   help="read the target's taps from DIR (make-taps, same --data and --seq-len) instead of "
                        "running the target in every step; --labels response only")
    p.add_argument("--resume", action="store_true", help="continue the run in OUT from its last checkpoint")
    # Training settings default to None: a fresh run fills in TrainConfig's defaults, --resume the
    # saved run's values (a flag given explicitly must agree with them).
    p.add_argument("--steps", type=POSITIVE, default=None)
    p.add_argument("--batch", type=POSITIVE, default=None, help="sequences per step")
    p.add_argument("--seq-len", type=_int_at_least(2), default=None, help="tokens per training row (prompt + response)")
    p.add_argument("--blocks", type=POSITIVE, default=None, help="anchors (blocks) per sequence")
    p.add_argument("--gamma", type=POSITIVE_FLOAT, default=None,
                   help="loss decay over a block's rows, or an MTP head's chained steps (default 7 for block "
                        "size 16, scaled with the rows)")
    p.add_argument("--lr", type=POSITIVE_FLOAT, default=None)
    p.add_argument("--warmup", type=_float_in(0.0, 1.0, high_open=True), default=None, help="warm-up fraction of the steps")
    p.add_argument("--weight-decay", type=_float_in(0.0), default=None)
    p.add_argument("--grad-clip", type=POSITIVE_FLOAT, default=None)
    p.add_argument("--compute-dtype", choices=("float32", "bfloat16"), default=None,
                   help="(default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--remat", action="store_true", default=None, help="recompute layers in the backward pass")
    p.add_argument("--seed", type=NON_NEGATIVE, default=None)
    p.add_argument("--labels", choices=("response", "target", "target-soft"), default=None,
                   help="what block row k learns: the response's token (default, the recipe) or the "
                        "target's own greedy token after the same prefix (what greedy decoding accepts; "
                        "differs from the response where it was sampled at T=1), or target-soft: the "
                        "target's whole next-token distribution there, loss KL(target || drafter)")
    p.add_argument("--dp", type=POSITIVE, default=None,
                   help="data-parallel devices: each step's --batch sequences are split over them, the "
                        "drafter and optimizer state replicated (--batch must divide by it; default 1, "
                        "with --resume the run's; a resumed run may change it)")
    p.add_argument("--tp", type=POSITIVE, default=None,
                   help="tensor-parallel devices inside each process (host): the frozen target is split over "
                        "them, dp runs over the rest (must divide each process's devices and the target's "
                        "heads; default 1, with --resume the run's; a resumed run may change it)")
    # Drafter shape (fresh runs only; --resume reads it from the run, --init from its drafter).
    p.add_argument("--drafter-kind", choices=("dflash", "mtp"), default=None,
                   help="dflash (default): a block-diffusion drafter; mtp: a one-layer MTP head for "
                        "`bench --method mtp --mtp-head OUT/mtp` (--layers, --block-size, --mask-token-id, "
                        "--blocks and --init are DFlash's)")
    p.add_argument("--mtp-init", choices=("target", "random"), default=None,
                   help="mtp: the head's layer starts as a copy of the target's last layer (default) or random")
    p.add_argument("--hidden-source", choices=("post_norm", "pre_norm"), default=None,
                   help="mtp: the target's last state after (default) or before its final norm")
    p.add_argument("--mtp-train-steps", type=POSITIVE, default=None,
                   help="mtp: chained head steps learned at each position (default 1: the first step only; "
                        "K: also steps 2..K from the head's own states, at (K + 1) / 2 times the cost a step)")
    p.add_argument("--init", default=None, metavar="DRAFTER",
                   help="start from this trained drafter (directory or shipped name) instead of random "
                        "weights: its shape, taps and mask token; the optimizer and schedule start afresh")
    p.add_argument("--block-size", type=BLOCK_SIZE, default=None, help="(default 16)")
    p.add_argument("--layers", type=POSITIVE, default=None, help="drafter layers, one target tap per layer (default 3)")
    p.add_argument("--mask-token-id", type=NON_NEGATIVE, default=None, help="(default: a special token chat never uses)")
    p.add_argument("--time-limit", type=POSITIVE_FLOAT, default=None,
                   help="seconds; stop (save, export) at the first step past it; --resume finishes later")
    p.add_argument("--stop-at", type=POSITIVE, default=None, metavar="STEP",
                   help="end this call after STEP steps of the schedule with a checkpoint; --resume finishes")
    p.add_argument("--save-every", type=POSITIVE, default=500)
    p.add_argument("--log-every", type=POSITIVE, default=10)
    # Validation (fresh runs; --resume reads them from the run, a flag given must agree).
    p.add_argument("--val-fraction", type=_float_in(0.0, 1.0, high_open=True), default=None,
                   help="fraction of the prompts held out for validation, all samples of a prompt on one "
                        "side, chosen by --seed (default 0.02; 0 = no validation)")
    p.add_argument("--eval-every", type=POSITIVE, default=None,
                   help="steps between validations (default: 10 x --log-every); also at the last step")
    p.add_argument("--val-batches", type=POSITIVE, default=None,
                   help="most validation batches (of --batch rows) evaluated each time (default 32)")
    p.add_argument("--keep-best", action="store_true", default=None,
                   help="export the parameters of the validation with the best tau estimate, not the last")
    p.add_argument("--export-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--measure-taps", action="store_true",
                   help="only time the taps forward against a whole step (JSON) and exit")
    _add_data_gen_args(p)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="tau, tokens/s and speedup over AR on prompt files, by category",
                       description="Benchmark AR, DFlash, DDTree and MTP on JSONL prompt files (gsm8k test "
                                   "`question` as category math, spec_bench `turns[0]` by `category`, "
                                   "make-prompts' code_heldout.jsonl as code). Prints a JSON report on stdout "
                                   "and tau by category as a table on stderr; with --out also writes "
                                   "report.json, tau_by_category.md and plots.")
    p.add_argument("--model", "--target", dest="model", default="smollm2")
    p.add_argument("--method", nargs="+", choices=("ar", "dflash", "ddtree", "mtp"), default=["dflash"],
                   help="methods to run (AR always runs as the baseline)")
    p.add_argument("--prompts", required=True, nargs="+", metavar="JSONL[:N]",
                   help="JSONL prompt files, decoded together; FILE:N takes the first N rows of one")
    p.add_argument("--draft", help="DFlash drafter directory")
    p.add_argument("--mtp-head", help="mtp: a checkpoint with the head's mtp.* tensors, or smollm2 (the head "
                   "shipped for SmolLM2); default: --model itself")
    p.add_argument("--budget", type=POSITIVE, nargs="+", default=[64], help="DDTree budgets")
    p.add_argument("--mtp-steps", type=POSITIVE, nargs="+", default=[1, 2, 3, 4],
                   help="mtp: a chain for each number of chained head steps")
    p.add_argument("--mtp-budget", type=POSITIVE, nargs="*", default=[],
                   help="mtp: also a tree of the most --mtp-steps for each of these node budgets")
    p.add_argument("--block-size", type=BLOCK_SIZE, default=None, help="(default: the drafter's)")
    p.add_argument("--max-new-tokens", type=POSITIVE, default=256)
    p.add_argument("--limit", type=POSITIVE, default=None, help="first N prompts of each file")
    p.add_argument("--batch", type=POSITIVE, default=1)
    p.add_argument("--temperature", type=TEMPERATURE, default=0.0)
    p.add_argument("--math-suffix", choices=("auto", "always", "never"), default="auto")
    p.add_argument("--seed", type=NON_NEGATIVE, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    p.add_argument("--tp", type=POSITIVE, default=1,
                   help="tensor-parallel devices for every method (must divide the q heads)")
    p.add_argument("--out", default=None, help="directory for report.json and plots")
    p.add_argument("--no-progress", action="store_true")


def _make_token_file(args: argparse.Namespace, cfg, params, tokenizer, out) -> None:
    from dflash_jax.train_data import default_sources, make_token_data

    if tokenizer is None:
        raise ValueError(f"--target {args.target}: no tokenizer found beside the weights")
    sources = args.prompts or default_sources(args.data_dir)
    data = make_token_data(params, cfg, tokenizer, sources, max_new_tokens=args.gen_tokens,
                           max_prompt_tokens=args.max_prompt_tokens, limit=args.limit,
                           batch_size=args.gen_batch, sample_fraction=args.sample_fraction,
                           temperature=args.gen_temperature, samples_per_prompt=args.samples_per_prompt,
                           math_suffix=args.math_suffix,
                           seed=args.seed or 0, target_name=str(args.target),
                           progress=not getattr(args, "no_progress", False))
    from dflash_jax import distributed as dist

    if dist.is_main():  # every process holds every response; one writes them
        data.save(Path(out))
        print(f"wrote {out}: {len(data)} sequences ({data.meta['prompts']} prompts x {args.samples_per_prompt}), "
              f"{len(data.response_tokens)} response tokens "
              f"({data.meta['skipped_long_prompts']} long prompts skipped)", file=sys.stderr)
    dist.barrier("make-data: token file written")  # before any process reads it


def _check_data_gen_args(args: argparse.Namespace) -> None:
    """Refuses bad generation flags, and --prompts files that are evaluation sets, before any
    model is loaded (`make_token_data` checks them again, after minutes of loading a large target)."""
    from dflash_jax.jsonl import file_and_limit
    from dflash_jax.train_data import check_samples, check_training_source

    check_samples(args.samples_per_prompt, args.gen_temperature)
    for spec in args.prompts or ():
        check_training_source(file_and_limit(spec)[0])


def cmd_make_data(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    _check_data_gen_args(args)
    check_writable(Path(args.out).absolute().parent, "--out")  # before the target answers every prompt
    cfg, params, tokenizer = _load_target(args.target, jnp.dtype(args.dtype or _default_dtype()), "--target")
    _make_token_file(args, cfg, params, tokenizer, args.out)
    return 0


def _train_tp(given: int | None, saved: dict[str, Any] | None) -> int:
    """--tp if given, else the resumed run's tp (1 for a run recorded before --tp existed), else 1."""
    if given is not None:
        return given
    return int(saved.get("tp", 1)) if saved is not None else 1


def _train_dp(given: int | None, saved: dict[str, Any] | None, tp: int = 1) -> int:
    """--dp if given, else every device of a multi-process run over tp, else the resumed run's dp
    (1 for a run recorded before --dp existed), else 1."""
    if given is not None:
        return given
    import jax

    if jax.process_count() > 1:
        return max(jax.device_count() // tp, 1)
    return int(saved.get("dp", 1)) if saved is not None else 1


def cmd_train(args: argparse.Namespace) -> int:
    import dataclasses

    import jax
    import jax.numpy as jnp

    from convert import load_model
    from dflash_jax import train as tr
    from dflash_jax.drafter import draft_config_from_dict
    from dflash_jax.sharding import ShardingError
    from dflash_jax.train_data import TokenData, build_sequences

    out = Path(args.out)
    run_file = out / tr.RUN_FILE
    given = {"steps": args.steps, "batch_size": args.batch, "seq_len": args.seq_len, "num_blocks": args.blocks,
             "gamma": args.gamma, "learning_rate": args.lr, "warmup_fraction": args.warmup,
             "weight_decay": args.weight_decay, "grad_clip": args.grad_clip,
             "compute_dtype": args.compute_dtype, "remat": args.remat, "seed": args.seed, "labels": args.labels,
             "mtp_steps": args.mtp_train_steps}
    given = {k: v for k, v in given.items() if v is not None}
    saved: dict[str, Any] | None = None  # the resumed run's train_run.json
    if args.resume and args.init:
        raise ValueError(f"--init starts a run; --resume continues {out} from its own checkpoint (drop --init)")
    if args.resume:
        if not run_file.is_file():
            raise FileNotFoundError(f"{out}: nothing to resume ({tr.RUN_FILE} is missing)")
        if not tr.finished_steps(out / "checkpoints"):
            raise ValueError(f"{out / 'checkpoints'}: no finished checkpoint to resume from (a run killed before "
                             f"its first save leaves none); start the run again without --resume")
        try:
            saved = json.loads(run_file.read_text())
            tc = tr.TrainConfig(**{**saved["train_config"], **given})
            drafter_config = saved["drafter_config"]
            saved_kind = "mtp" if drafter_config.get("kind") == "mtp" else "dflash"
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{run_file}: not a readable run record ({type(err).__name__}: {err})") from None
        if args.drafter_kind not in (None, saved_kind):
            raise ValueError(f"--drafter-kind {args.drafter_kind} disagrees with the run in {out} ({saved_kind})")
        args.drafter_kind = saved_kind
        # An MTP head's config holds the target's: built once the target is loaded.
        dcfg = None if saved_kind == "mtp" else draft_config_from_dict(drafter_config, source=str(run_file))
        args.data = args.data or saved.get("data")
        args.taps = args.taps or saved.get("taps")
        val = saved.get("validation") or {"fraction": 0.0, "eval_every": None, "val_batches": 32, "keep_best": False}
    else:
        given.setdefault("compute_dtype", _default_dtype())
        tc = dataclasses.replace(tr.TrainConfig(), **given)
        dcfg = None
        val = {"fraction": 0.02, "eval_every": None, "val_batches": 32, "keep_best": False}
    mtp_head = args.drafter_kind == "mtp"
    mtp_flags = [flag for flag, v in (("--mtp-init", args.mtp_init), ("--hidden-source", args.hidden_source))
                 if v is not None]
    if (mtp_flags or args.mtp_train_steps is not None) and not mtp_head:
        flag = mtp_flags[0] if mtp_flags else "--mtp-train-steps"
        raise ValueError(f"{flag} is an MTP head's setting: pass --drafter-kind mtp")
    if mtp_flags and args.resume:
        raise ValueError(f"{mtp_flags[0]} starts a run; --resume continues {out} with its own (drop it)")
    if mtp_head:
        dflash_only = [flag for flag, v in (("--init", args.init), ("--layers", args.layers),
                                            ("--block-size", args.block_size), ("--mask-token-id", args.mask_token_id),
                                            ("--blocks", args.blocks)) if v is not None]
        if dflash_only:
            raise ValueError(f"{dflash_only[0]} is a DFlash drafter's setting; --drafter-kind mtp trains a "
                             f"one-layer head on every response position")
    val_fraction = val["fraction"] if args.val_fraction is None else args.val_fraction
    eval_every = val["eval_every"] if args.eval_every is None else args.eval_every
    val_batches = val["val_batches"] if args.val_batches is None else args.val_batches
    keep_best = val["keep_best"] if args.keep_best is None else args.keep_best
    tr.check_validation(val_fraction, eval_every, val_batches, keep_best)  # before the target is loaded
    tp = _train_tp(args.tp, saved)
    dp = _train_dp(args.dp, saved, tp)
    tr.check_data_parallel(dp, tc.batch_size, tp)  # before the target is loaded
    _check_data_gen_args(args)
    check_writable(out, "--out")  # before the target is loaded
    if (out / "checkpoints").exists():
        check_writable(out / "checkpoints", "--out's checkpoints")
    data_path = Path(args.data) if args.data else out / "train_tokens.npz"
    if not data_path.is_file() and not args.data_gen:  # before the target is loaded
        raise FileNotFoundError(f"{data_path}: no token file; run `dflash-jax make-data --out {data_path}` "
                                f"or pass --data-gen")
    store = None
    if args.taps:  # read before the target loads: a wrong directory costs no load
        from dflash_jax.train_data import TapStore

        try:
            store = TapStore.open(args.taps)
        except (OSError, ValueError) as err:
            raise ValueError(f"--taps: {err}; write them with `dflash-jax make-taps --out {args.taps}`") from None
        if not store.complete:
            raise ValueError(f"--taps {args.taps}: incomplete (make-taps stopped before it wrote every row; its "
                             f"missing rows read as zeros); run make-taps again")
    # Frozen target: loaded straight in the compute dtype, which is all `train` keeps of it (the
    # same rounding as a float32 load cast afterwards, at half the memory: a 27B target in bf16 is
    # 54 GB, in float32 108). Under --tp each weight goes straight to its tp shards.
    mesh = tr.data_parallel_mesh(dp, tc.batch_size, tp) if tp > 1 else None
    try:
        cfg, params, tokenizer = load_model(args.target, dtype=jnp.dtype(tc.compute_dtype), mesh=mesh)
    except ShardingError as err:
        raise ShardingError(f"tp (--tp) = {tp} does not fit the target {args.target}: {err}") from None
    if not data_path.is_file():  # --data-gen
        _make_token_file(args, cfg, params, tokenizer, data_path)
    data = TokenData.load(data_path)
    init_params = init = None
    if mtp_head:
        if saved is not None:
            dcfg = tr.drafter_config_from_dict(saved["drafter_config"], cfg, str(run_file))
        else:
            from dflash_jax import mtp

            dcfg = mtp.MTPConfig(cfg, hidden_source=args.hidden_source or "post_norm")
            mtp_init = args.mtp_init or "target"
            if mtp_init == "target":
                init_params = mtp.head_from_target(params, cfg, jax.random.key(tc.seed + 1))
            init = {"mtp_init": mtp_init}
    elif args.init:
        dcfg, init_params = tr.drafter_from_init(args.init, cfg, num_layers=args.layers, block_size=args.block_size,
                                                 mask_token_id=args.mask_token_id)
        init = tr.init_record(args.init)
    elif dcfg is None:
        mask = args.mask_token_id if args.mask_token_id is not None else tr.choose_mask_token(tokenizer, cfg.vocab_size)
        dcfg = tr.drafter_config_for(cfg, num_layers=3 if args.layers is None else args.layers,
                                     block_size=16 if args.block_size is None else args.block_size,
                                     mask_token_id=mask)
    seqs = build_sequences(data, tc.seq_len)
    if store is not None:
        seqs = tr.TappedSequences(seqs, store)
    if args.measure_taps:
        print(json.dumps({**tr.time_step_parts(params, cfg, dcfg, seqs, tc, dp=dp, tp=tp),
                          "train_config": tc.to_dict(), "dp": dp, "tp": tp}))
        return 0
    what = (f"an MTP head ({dcfg.hidden_source} states)" if mtp_head else
            f"a {dcfg.num_layers}-layer block-{dcfg.block_size} drafter (taps {list(dcfg.target_layer_ids)}, "
            f"mask token {dcfg.mask_token_id})")
    print(f"training {what} on {len(seqs)} sequences from {data_path}"
          + (f", batch split over {dp} dp groups" if dp > 1 else "")
          + (f", target split over {tp} devices" if tp > 1 else ""), file=sys.stderr)
    result = tr.train(params, cfg, dcfg, seqs, tc, out, init_params=init_params, resume=args.resume,
                      save_every=args.save_every, stop_at=args.stop_at,
                      log_every=args.log_every, time_limit=args.time_limit, export_dtype=args.export_dtype,
                      val_fraction=val_fraction, eval_every=eval_every, val_batches=val_batches,
                      keep_best=keep_best, progress=not args.no_progress, dp=dp, tp=tp,
                      extra_record={"target": str(args.target), "data": str(data_path), "taps": args.taps,
                                    "init": saved.get("init") if saved else init})
    print(json.dumps({"out": str(result.out_dir), **result.summary}))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from dflash_jax import evaluate as ev
    from dflash_jax import sharding as sh
    from dflash_jax.sampling import SamplingParams

    spec_methods = [m for m in args.method if m != "ar"]
    dflash_methods = [m for m in spec_methods if m != "mtp"]
    if dflash_methods and not args.draft:
        raise ValueError(f"--method {' '.join(dflash_methods)} needs --draft DIR (a DFlash drafter directory)")
    dtype = jnp.dtype(args.dtype or _default_dtype())
    prompts = ev.load_bench_files(args.prompts, limit=args.limit, math_suffix=args.math_suffix)
    out = check_writable(args.out, "--out") if args.out else None  # before minutes of decoding
    if "mtp" in spec_methods:
        _mtp_head_source(args.mtp_head, args.model, "--mtp-head")  # before the target loads
    mesh = sh.make_mesh(1, args.tp) if args.tp > 1 else None
    cfg, params, tokenizer = _load_target(args.model, dtype, mesh=mesh)
    dcfg = dparams = None
    block_size = args.block_size or 16
    if dflash_methods:
        dcfg, dparams = _load_drafter_for(args.draft, cfg, dtype, mesh)
        block_size = args.block_size or dcfg.block_size
    mtp_cfg = mtp_params = None
    if "mtp" in spec_methods:
        mtp_cfg, mtp_params = _load_mtp_head_for(args.mtp_head, args.model, cfg, dtype, "--mtp-head", mesh)
    specs = ev.method_specs(spec_methods, args.budget, block_size, args.mtp_steps, args.mtp_budget)
    where = {"prompts_files": [str(p) for p in args.prompts], "model": str(args.model), "draft": args.draft,
             "mtp_head": args.mtp_head, "tp": args.tp}

    def write(report: dict[str, Any]) -> None:
        # Each method's results are on disk as soon as it finishes: a later failure loses only
        # the method it happened in.
        if out is not None:
            atomic_write_text(out / "report.json", json.dumps({**report, **where}, indent=2) + "\n")

    with sh.use_mesh(mesh):  # every method traced and compiled sharded over the mesh (no-op without one)
        report = ev.run_bench(params, cfg, tokenizer, prompts, specs, dparams=dparams, dcfg=dcfg,
                              mtp_params=mtp_params, mtp_cfg=mtp_cfg, max_new_tokens=args.max_new_tokens,
                              batch_size=args.batch,
                              sampling=SamplingParams(args.temperature), seed=args.seed,
                              progress=not args.no_progress, on_result=write)
    report.update(where)
    print(json.dumps(report))  # before the plots: a plotting failure cannot lose the numbers
    if spec_methods:
        table = ev.category_table(report)
        print(table, file=sys.stderr, end="")
        if out is not None:
            atomic_write_text(out / "tau_by_category.md", table)
    if out is not None:
        ev.plot_report(report, out)
    return 0


def cmd_make_prompts(args: argparse.Namespace) -> int:
    from dflash_jax import prompt_sets

    sets = tuple(args.sets) or (() if args.answers else prompt_sets.SETS)
    prompt_sets.check_sets(sets)  # before --out is made
    if args.answers and not Path(args.answers).is_file():
        raise ValueError(f"--answers: {args.answers}: no such file")
    check_writable(args.out, "--out")
    meta = prompt_sets.build(args.out, sets) if sets else {}
    if args.answers:
        meta = prompt_sets.build_derived(args.answers, args.out)
    print(json.dumps({"out": str(args.out), **meta}))
    return 0


def _add_compare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="our target against the PyTorch reference, layer by layer",
                       description="Run our target and transformers' on the same token ids: per-layer hidden "
                                   "state errors, logits agreement, greedy continuations and a verdict "
                                   "(agree / near-tie / real disagreement). Needs `pip install 'dflash-jax[compare]'`.")
    p.add_argument("--model", default="smollm2", help="'smollm2', a .gguf file or an HF directory")
    p.add_argument("--draft", help="also compare this DFlash drafter (directory, or 'smollm2') with dflash 0.1.0's")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help="prompt text (chat template applied)")
    src.add_argument("--prompts", default=None, help="JSONL file; each row's 'prompt', 'question' or 'text'")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--tokens", type=POSITIVE, default=32, help="greedy continuation length")
    p.add_argument("--out", default=None, help="directory for compare.json and compare_layers.png")


def cmd_compare(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from dflash_jax import compare as cmp
    from dflash_jax import pipeline

    texts = [args.prompt or "Give me three tips for a good night's sleep."]
    if args.prompts:
        from dflash_jax.jsonl import iter_jsonl

        texts = []
        for line_no, row in iter_jsonl(args.prompts):
            text = row.get("prompt", row.get("question", row.get("text")))
            if not isinstance(text, str) or not text:
                raise ValueError(f"{args.prompts}:{line_no}: no 'prompt', 'question' or 'text' string")
            texts.append(text)
    cmp.require_reference("torch", "transformers", *(("dflash",) if args.draft else ()))  # before loading
    out = check_writable(args.out, "--out") if args.out else None
    cfg, params, tokenizer = _load_target(args.model, jnp.dtype(args.dtype))
    reference = cmp.load_reference(args.model, args.dtype)
    drafter = None
    if args.draft:
        dcfg, dparams = _load_drafter_for(args.draft, cfg, jnp.dtype(args.dtype))
        drafter = cmp.load_reference_drafter(args.draft, args.dtype)
    reports = []
    for text, ids in zip(texts, pipeline.encode_prompts(tokenizer, texts)):
        report = cmp.compare_target(params, cfg, reference, ids, tokens=args.tokens, dtype=args.dtype)
        report["prompt"] = text
        if drafter is not None:
            report["drafter"] = cmp.compare_drafter(params, cfg, dparams, dcfg, reference, drafter, ids,
                                                    dtype=args.dtype)
            if report["drafter"]["first_bad_depth"] is not None and report["first_bad_layer"] is None:
                report["verdict"] = (f"real disagreement: the drafter's depth {report['drafter']['first_bad_depth']} "
                                     f"logits leave tolerance; the target: {report['verdict']}")
        reports.append(report)
        print(f">>> {text}\n{cmp.format_table(report)}\n")
    if out is not None:
        atomic_write_text(out / "compare.json", json.dumps({"model": str(args.model), "reports": reports},
                                                           indent=2) + "\n")
        cmp.plot_layers(reports[0], out / "compare_layers.png")
    return 0


def _add_decode(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("decode", help="decode a JSONL prompt file into a JSONL answer file (batched, resumable)",
                       description="Decode every prompt of --input ('prompt', 'question', 'instruction' or "
                                   "'turns'[0]) into "
                                   "--output: one row per prompt, the input row plus text, num_tokens, tau, rounds "
                                   "and seconds, appended as each batch finishes. A rerun skips ids already answered.")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--input", required=True, help="JSONL prompt file")
    p.add_argument("--output", required=True, help="JSONL answer file (appended to; resumed)")
    p.add_argument("--method", choices=("ar", "dflash", "ddtree", "mtp"), default="ar")
    p.add_argument("--draft", help="DFlash drafter directory, or 'smollm2'; for --method mtp the MTP head: a "
                                   "checkpoint with mtp.* tensors or 'smollm2' (default: --model itself)")
    p.add_argument("--budget", type=POSITIVE, default=64, help="DDTree node budget")
    p.add_argument("--mtp-steps", type=POSITIVE, default=3, help="mtp: chained head steps per round")
    p.add_argument("--mtp-budget", type=NON_NEGATIVE, default=0,
                   help="mtp: tree nodes per round (0: verify the steps as a chain)")
    p.add_argument("--batch", type=POSITIVE, required=True, help="prompts per compiled batch")
    p.add_argument("--max-new-tokens", type=POSITIVE, default=128)
    p.add_argument("--temperature", type=TEMPERATURE, default=0.0)
    p.add_argument("--seed", type=NON_NEGATIVE, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    p.add_argument("--no-chat", action="store_true", help="do not wrap prompts in the chat template")
    p.add_argument("--no-progress", action="store_true")


def cmd_decode(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from dflash_jax import decode
    from dflash_jax.sampling import SamplingParams

    if args.method not in ("ar", "mtp") and not args.draft:
        raise ValueError(f"--method {args.method} needs --draft PATH (a DFlash drafter directory)")
    decode.read_prompts(args.input)  # a malformed line is refused before any model is loaded
    check_writable(Path(args.output).absolute().parent, "--output")
    if args.method == "mtp":
        _mtp_head_source(args.draft, args.model)  # before the target loads
    dtype = jnp.dtype(args.dtype or _default_dtype())
    cfg, params, tokenizer = _load_target(args.model, dtype)
    dcfg = dparams = None
    if args.method == "mtp":
        dcfg, dparams = _load_mtp_head_for(args.draft, args.model, cfg, dtype)
    elif args.method != "ar":
        dcfg, dparams = _load_drafter_for(args.draft, cfg, dtype)
    summary = decode.decode_file(params, cfg, tokenizer, args.input, args.output, method=args.method,
                                 dparams=dparams, dcfg=dcfg, budget=args.budget, mtp_steps=args.mtp_steps,
                                 mtp_budget=args.mtp_budget, batch=args.batch,
                                 max_new_tokens=args.max_new_tokens, sampling=SamplingParams(args.temperature),
                                 seed=args.seed, chat=not args.no_chat, progress=not args.no_progress)
    import jax

    if jax.process_index() == 0:  # the process that wrote the answers has the run's totals
        print(json.dumps(summary))
    return 0


def _one_line(err: BaseException) -> str:
    """The error's message on one line (an OSError's own str() already names its file)."""
    text = " ".join(str(err).split()) or type(err).__name__
    if isinstance(err, OSError) and err.filename is not None and str(err.filename) not in text:
        text = f"{err.filename}: {text}"
    return text


# Failures that bad input, a missing or unwritable file or a full disk cause: one line, exit 2.
# Anything else is a bug and keeps its traceback. (zipfile.BadZipFile and orbax's errors are
# turned into ValueErrors naming the file where they are raised.)
EXPECTED_ERRORS = (ValueError, OSError)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:
        if exit_.code == 2:  # a usage error, already printed on one line
            return 2
        raise
    command = {"generate": cmd_generate, "convert": cmd_convert, "make-prompts": cmd_make_prompts,
               "make-data": cmd_make_data, "make-taps": cmd_make_taps,
               "train": cmd_train, "bench": cmd_bench, "compare": cmd_compare,
               "decode": cmd_decode}[args.command]
    from convert import validate

    validate.CHECK_WEIGHTS_DEFAULT = not args.no_weight_check
    try:
        if args.command in MULTI_PROCESS:
            # Before anything touches a device: jax.distributed must come first.
            from dflash_jax import distributed as dist

            dist.initialize(dist.cluster_from(args.coordinator, args.num_processes, args.process_id))
        return command(args)
    except EXPECTED_ERRORS as err:
        if args.debug:
            raise
        print(f"dflash-jax {args.command}: error: {_one_line(err)}", file=sys.stderr)
        if argv is None and stuck_threads():
            # Run as a program: after some failures orbax's writer threads wait forever for a
            # signal, and the interpreter would wait for them at exit. The error is reported and
            # nothing is left to write, so leave without them.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(2)
        return 2
    finally:
        validate.CHECK_WEIGHTS_DEFAULT = True  # for whatever loads in this process later


if __name__ == "__main__":
    sys.exit(main())
