"""Benchmarks of AR, DFlash, DDTree and MTP decoding on prompt files: tau, tokens/s, speedup over AR.

Prompt files (JSONL, see ../shared/data/README.md), several at once (`load_bench_files`):
  gsm8k test   `question`; a math set, so it gets MATH_SUFFIX (the papers' convention) and
               the category "math";
  spec_bench   `turns[0]` (the first turn), grouped by `category`;
  otherwise    `instruction` / `prompt` / `question`, grouped by `category` (make-prompts'
               held-out code set: "code"), else by the file's folder name.
A category that two files share is qualified by each file's set ("gsm8k/math", "spec_bench/math").
Every report is broken down by category (`by_category`, `category_table`).
Prompts are wrapped in the target's chat template. Every method decodes the same prompts
with the same settings; tokens/s excludes compilation (each program is compiled ahead of
time, once per prompt-width bucket). With greedy decoding the speculative outputs are also
checked against AR's, token for token (`matches_ar`). Dense targets (Qwen3, Llama) and
Qwen3.5 / Qwen3.6 hybrids run alike: `ar_program` and `speculative.target_family` pick the
decoder by the config.

tau = tokens committed per target verification round (accepted drafted tokens + the bonus),
summed over all rounds of all prompts, divided by the number of rounds.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.impl import Impl
from dflash_jax.jsonl import file_and_limit, iter_jsonl
from dflash_jax.sampling import SamplingParams

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
METHODS = ("ar", "dflash", "ddtree", "mtp")


MATH_SUFFIX_MODES = ("auto", "always", "never")


def check_math_suffix(mode: str) -> None:
    if mode not in MATH_SUFFIX_MODES:
        raise ValueError(f"math_suffix (--math-suffix) must be auto, always or never, got {mode!r}")


def with_math_suffix(text: str, is_math: bool, mode: str) -> str:
    """`text` + MATH_SUFFIX when mode is "always", or "auto" and the row is a math problem.

    Evaluation and drafter training both use it, so a drafter learns the responses that the
    suffixed evaluation prompts get.
    """
    return text + MATH_SUFFIX if mode == "always" or (mode == "auto" and is_math) else text


@dataclasses.dataclass(frozen=True)
class BenchPrompt:
    text: str
    category: str


def load_bench_prompts(path: str | Path, limit: int | None = None, math_suffix: str = "auto"
                       ) -> list[BenchPrompt]:
    """Prompts of a benchmark JSONL file (first `limit` rows).

    math_suffix: "auto" adds MATH_SUFFIX to math sets (rows with `question` + `answer`, as
    gsm8k), "always" / "never" force it. Category: the row's `category`, else "math" for a
    math row, else the file's folder name.
    """
    check_math_suffix(math_suffix)
    path = Path(path)
    default_category = path.parent.name or path.stem
    out = []
    for line_no, row in iter_jsonl(path):
        if "turns" in row:
            turns = row["turns"]
            if not (isinstance(turns, list) and turns and isinstance(turns[0], str)):
                raise ValueError(f"{path}:{line_no}: field 'turns' must be a non-empty list of strings, "
                                 f"got {json.dumps(turns)[:40]}")
            text, is_math = turns[0], False
        elif isinstance(row.get("question"), str):
            text, is_math = row["question"], "answer" in row
        else:
            key = next((k for k in ("instruction", "prompt") if isinstance(row.get(k), str)), None)
            if key is None:
                raise ValueError(f"{path}:{line_no}: no prompt (expected turns, question, "
                                 f"instruction or prompt)")
            text, is_math = row[key], False
        text = with_math_suffix(text, is_math, math_suffix)
        category = row.get("category", "math" if is_math else default_category)
        out.append(BenchPrompt(text=text, category=str(category)))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def load_bench_files(specs: Sequence[str | Path], limit: int | None = None, math_suffix: str = "auto"
                     ) -> list[BenchPrompt]:
    """The prompts of several files, in the order given. A spec is "FILE" or "FILE:N" (its first
    N rows, `jsonl.file_and_limit`); `limit` caps every file (the smaller cap wins).

    A category found in more than one file is named "SET/category" in each (SET: the file's
    folder name, else its stem), so that gsm8k's "math" and spec_bench's own "math" prompts are
    reported apart rather than pooled.
    """
    if not specs:
        raise ValueError("--prompts: no prompt file given")
    per_file: list[tuple[str, list[BenchPrompt]]] = []
    for spec in specs:
        path, cap = file_and_limit(spec)
        cap = cap if limit is None else limit if cap is None else min(cap, limit)
        per_file.append((path.parent.name or path.stem, load_bench_prompts(path, limit=cap, math_suffix=math_suffix)))
    files_of: dict[str, set[int]] = {}
    for i, (_, rows) in enumerate(per_file):
        for r in rows:
            files_of.setdefault(r.category, set()).add(i)
    return [BenchPrompt(r.text, f"{name}/{r.category}" if len(files_of[r.category]) > 1 else r.category)
            for name, rows in per_file for r in rows]


def category_table(report: dict[str, Any]) -> str:
    """tau of every speculative method by category, a Markdown table: one row per category (in
    order of first appearance), then "all" (pooled over every round) and "category mean" (each
    category weighted alike, so that a large set does not drown a small one)."""
    methods = {name: rec for name, rec in report["methods"].items() if rec["method"] != "ar"}
    first = next(iter(report["methods"].values()))
    cats = list(first["by_category"])
    lines = ["| category | prompts | " + " | ".join(f"{m} tau" for m in methods) + " |",
             "|---|---:|" + "---:|" * len(methods)]
    for cat in cats:
        taus = " | ".join(f"{rec['by_category'][cat]['tau']:.2f}" for rec in methods.values())
        lines.append(f"| {cat} | {first['by_category'][cat]['prompts']} | {taus} |")
    lines.append(f"| all | {first['prompts']} | " + " | ".join(f"{r['tau']:.2f}" for r in methods.values()) + " |")
    lines.append(f"| category mean | {len(cats)} | "
                 + " | ".join(f"{r['tau_category_mean']:.2f}" for r in methods.values()) + " |")
    return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """One decoder to benchmark: "ar", "dflash" (block_size), "ddtree" (block_size, budget) or
    "mtp" (mtp_steps; a chain at budget 0, else a tree of `budget` nodes)."""

    method: str
    block_size: int = 16
    budget: int = 0
    mtp_steps: int = 0

    @property
    def name(self) -> str:
        if self.method == "ar":
            return "ar"
        if self.method == "dflash":
            return f"dflash(bs={self.block_size})"
        if self.method == "mtp":
            return f"mtp(k={self.mtp_steps})" if not self.budget else f"mtp(k={self.mtp_steps},budget={self.budget})"
        return f"ddtree(bs={self.block_size},budget={self.budget})"


def method_specs(methods: Sequence[str], budgets: Sequence[int], block_size: int, mtp_steps: Sequence[int] = (1,),
                 mtp_budgets: Sequence[int] = ()) -> list[MethodSpec]:
    """The AR baseline first, then each method (DDTree once per budget; MTP a chain per number of
    steps in `mtp_steps`, then a tree of the most steps per budget in `mtp_budgets`)."""
    out = [MethodSpec("ar")]
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; expected one of {METHODS}")
        if m == "dflash":
            out.append(MethodSpec("dflash", block_size))
        elif m == "ddtree":
            if not budgets:
                raise ValueError("--method ddtree needs at least one --budget")
            out += [MethodSpec("ddtree", block_size, int(b)) for b in budgets]
        elif m == "mtp":
            if not mtp_steps:
                raise ValueError("--method mtp needs at least one --mtp-steps")
            out += [MethodSpec("mtp", int(k) + 1, 0, int(k)) for k in mtp_steps]
            out += [MethodSpec("mtp", max(mtp_steps) + 1, int(b), max(mtp_steps)) for b in mtp_budgets]
    return list(dict.fromkeys(out))  # de-duplicated, in order


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "max_len", "sampling", "stop_tokens", "impl"))
def _hybrid_generate(params: Any, cfg: Any, prompts: jax.Array, prompt_lens: jax.Array, key: jax.Array, *,
                     max_new_tokens: int, max_len: int, sampling: SamplingParams = SamplingParams(),
                     stop_tokens: tuple[int, ...] = (), impl: Impl = Impl()) -> Any:
    """`qwen3_5.generate` returning a `generate.Generation`, as `generate.generate_ar` does."""
    from dflash_jax import qwen3_5
    from dflash_jax.generate import Generation

    return Generation(*qwen3_5.generate(params, cfg, prompts, prompt_lens, key, max_new_tokens=max_new_tokens,
                                        max_len=max_len, sampling=sampling, stop_tokens=stop_tokens,
                                        attn_impl=impl.attention))


def ar_program(cfg: Any, impl: Impl = Impl()) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The jitted AR decoder of a target and its extra keyword arguments: `generate.generate_ar`
    (with `impl`) for a dense target, `qwen3_5.generate` for a Qwen3.5 / Qwen3.6 hybrid (with
    `impl.attention`), as `speculative.target_family` picks by the config. Both take (params, cfg,
    prompts [B, P], prompt_lens [B], key, *, max_new_tokens, max_len, sampling, stop_tokens) and
    return a `generate.Generation`. Kept apart (not one jitted wrapper) so the dense decoder keeps
    its own compiler options."""
    from dflash_jax.generate import generate_ar
    from dflash_jax.speculative import HYBRID, target_family

    if target_family(cfg) is HYBRID:
        return _hybrid_generate, {"impl": impl}
    return generate_ar, {"impl": impl}


def bench_tokens(params: Any, cfg: Any, token_lists: Sequence[Sequence[int]], categories: Sequence[str],
                 specs: Sequence[MethodSpec], *, dparams: Any = None, dcfg: Any = None,
                 mtp_params: Any = None, mtp_cfg: Any = None, max_new_tokens: int = 256, batch_size: int = 1,
                 stop_tokens: tuple[int, ...] = (),
                 sampling: SamplingParams = SamplingParams(), seed: int = 0, width_multiple: int = 64,
                 progress: bool = True, impl: Impl = Impl(),
                 on_result: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Runs every method over the token prompts; returns the JSON-ready report.

    Prompts are decoded in their given order, `batch_size` at a time, every batch right-padded
    to the longest prompt rounded up to `width_multiple`: one compiled program per method (on a
    GPU a compile costs more than the padded prefill rows). impl: how every method computes
    (`impl.Impl`). `on_result(report)` is called after each method with the report so far
    (`"complete": False` until the last), so that a caller can write results as they are made.
    dparams, dcfg: the DFlash drafter of "dflash" / "ddtree"; mtp_params, mtp_cfg: the MTP head
    of "mtp" (`dflash_jax.mtp`).
    """
    from tqdm.auto import tqdm

    from dflash_jax.generate import check_prompts
    from dflash_jax.pipeline import Compiled, default_max_len, pad_prompts, padded_width
    from dflash_jax.speculative import SpecSettings, speculative_program

    if not token_lists:
        raise ValueError("no prompts to benchmark")
    if len(token_lists) != len(categories):
        raise ValueError("token_lists and categories differ in length")
    if not specs or specs[0].method != "ar":
        raise ValueError("the methods to benchmark must start with the AR baseline (see method_specs)")
    if any(s.method in ("dflash", "ddtree") for s in specs) and dparams is None:
        raise ValueError("dflash / ddtree need a drafter (--draft DIR)")
    if any(s.method == "mtp" for s in specs) and mtp_params is None:
        raise ValueError("mtp needs an MTP head (--mtp-head PATH)")

    def drafter(spec: MethodSpec) -> tuple[Any, Any]:
        return (mtp_params, mtp_cfg) if spec.method == "mtp" else (dparams, dcfg)
    n = len(token_lists)
    batches = [list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]
    width = padded_width(token_lists, width_multiple)
    compiled = Compiled()
    ar_fn, ar_extra = ar_program(cfg, impl)
    per_method: dict[str, dict[str, Any]] = {}
    outputs: dict[str, list[list[int]]] = {}
    all_settings = [None if spec.method == "ar" else
                    SpecSettings(method=spec.method, block_size=spec.block_size, budget=spec.budget,
                                 mtp_steps=spec.mtp_steps, sampling=sampling, max_new_tokens=max_new_tokens,
                                 stop_tokens=stop_tokens)
                    for spec in specs]
    lens_all = np.array([len(t) for t in token_lists], np.int32)
    itemsize = int(np.dtype(jax.tree.leaves(params)[0].dtype).itemsize)
    for spec, settings in zip(specs, all_settings):  # every method's sizes, before the first one runs
        slack = 1 if settings is None else settings.cache_slack()
        check_prompts(lens_all, width, max_new_tokens, default_max_len(width, max_new_tokens, slack), slack,
                      cfg=cfg, dcfg=None if settings is None else drafter(spec)[1], itemsize=itemsize)
    for spec, settings in zip(specs, all_settings):
        slack = 1 if settings is None else settings.cache_slack()
        seq_tokens = [0] * n
        seq_seconds = [0.0] * n
        seq_committed = [0] * n
        seq_rounds = [0] * n
        outs: list[list[int]] = [[] for _ in range(n)]
        bar = tqdm(total=n, desc=spec.name, disable=not progress, unit="prompt")
        for b, idx in enumerate(batches):
            chunk = [list(token_lists[i]) for i in idx]
            chunk += [chunk[-1]] * (batch_size - len(chunk))
            arr, lens = pad_prompts(chunk, width=width)
            max_len = default_max_len(arr.shape[1], max_new_tokens, slack)
            key = jax.random.key(seed + b)
            if settings is None:
                gen, secs = compiled.run(
                    ("ar", arr.shape, max_len), ar_fn,
                    (params, cfg, jnp.asarray(arr), jnp.asarray(lens), key),
                    dict(max_new_tokens=max_new_tokens, max_len=max_len, sampling=sampling,
                         stop_tokens=tuple(stop_tokens), **ar_extra))
            else:
                gen, secs = compiled.run(
                    (spec, arr.shape, max_len), speculative_program(settings),
                    (params, cfg, *drafter(spec), jnp.asarray(arr), jnp.asarray(lens), key),
                    dict(settings=settings, max_len=max_len, impl=impl))
            toks, counts = np.asarray(gen.tokens), np.asarray(gen.num_tokens)
            for row, i in enumerate(idx):
                outs[i] = toks[row, :counts[row]].tolist()
                seq_tokens[i] = int(counts[row])
                seq_seconds[i] = secs / len(idx)  # a batch's time, shared by its real prompts
                if gen.rounds is not None:
                    r = int(np.asarray(gen.rounds)[row])
                    seq_rounds[i] = r
                    seq_committed[i] = int(np.asarray(gen.accepted)[row, :r].sum())
            bar.update(len(idx))
        bar.close()
        outputs[spec.name] = outs
        rec = per_method[spec.name] = _summary(spec, seq_tokens, seq_seconds, seq_committed, seq_rounds,
                                               categories)
        ar = per_method["ar"]  # method_specs puts the baseline first
        rec["speedup_over_ar"] = rec["tokens_per_second"] / ar["tokens_per_second"]
        for cat, c in rec["by_category"].items():
            c["speedup_over_ar"] = c["tokens_per_second"] / ar["by_category"][cat]["tokens_per_second"]
        if spec.name != "ar" and sampling.greedy:
            same = [o == a for o, a in zip(outputs[spec.name], outputs["ar"])]
            rec["matches_ar"] = sum(same) / len(same)
        report = {"methods": per_method, "num_prompts": n, "max_new_tokens": max_new_tokens,
                  "batch_size": batch_size, "temperature": sampling.temperature,
                  "compile_seconds": compiled.compile_seconds, "device": str(jax.devices()[0].device_kind),
                  "backend": jax.default_backend(), "jax_version": jax.__version__,
                  "complete": len(per_method) == len(specs)}
        if on_result is not None:
            on_result(report)
    return report


def _summary(spec: MethodSpec, tokens: list[int], seconds: list[float], committed: list[int],
             rounds: list[int], categories: Sequence[str]) -> dict[str, Any]:
    def agg(ix: list[int]) -> dict[str, Any]:
        t, s = sum(tokens[i] for i in ix), sum(seconds[i] for i in ix)
        rec = {"prompts": len(ix), "tokens": t, "seconds": s, "tokens_per_second": t / max(s, 1e-12)}
        if spec.method != "ar":
            r = sum(rounds[i] for i in ix)
            rec["rounds"] = r
            rec["tau"] = sum(committed[i] for i in ix) / max(r, 1)
        return rec

    groups: dict[str, list[int]] = defaultdict(list)
    for i, c in enumerate(categories):
        groups[c].append(i)
    out = {"method": spec.method, "block_size": spec.block_size if spec.method != "ar" else None,
           "budget": spec.budget if spec.method in ("ddtree", "mtp") else None,
           "mtp_steps": spec.mtp_steps if spec.method == "mtp" else None, **agg(list(range(len(tokens))))}
    out["by_category"] = {c: agg(ix) for c, ix in groups.items()}
    if spec.method != "ar":
        out["tau_category_mean"] = float(np.mean([c["tau"] for c in out["by_category"].values()]))
    return out


def run_bench(params: Any, cfg: Any, tokenizer: Any, prompts: Sequence[BenchPrompt], specs: Sequence[MethodSpec],
              **kwargs: Any) -> dict[str, Any]:
    """Text prompts -> chat template -> `bench_tokens`."""
    from dflash_jax.pipeline import encode_prompts, stop_tokens_for

    token_lists = encode_prompts(tokenizer, [p.text for p in prompts])
    kwargs.setdefault("stop_tokens", stop_tokens_for(tokenizer, cfg))
    return bench_tokens(params, cfg, token_lists, [p.category for p in prompts], specs, **kwargs)


def plot_report(report: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """tau_by_category.png (speculative methods) and speed.png (tokens/s and speedup per method)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    methods = report["methods"]
    paths = []
    spec_names = [m for m in methods if methods[m]["method"] != "ar"]
    if spec_names:
        cats = list(methods[spec_names[0]]["by_category"])
        x = np.arange(len(cats) + 1)
        width = 0.8 / len(spec_names)
        fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(x) + 2), 4))
        for j, name in enumerate(spec_names):
            rec = methods[name]
            vals = [rec["by_category"][c]["tau"] for c in cats] + [rec["tau"]]
            ax.bar(x + (j - (len(spec_names) - 1) / 2) * width, vals, width, label=name)
        ax.set_xticks(x)
        ax.set_xticklabels(cats + ["all"], rotation=45, ha="right")
        ax.set_ylabel("tau (tokens per round)")
        ax.set_title("Acceptance length by category")
        ax.legend()
        fig.tight_layout()
        p = out_dir / "tau_by_category.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    names = list(methods)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(names) + 2), 4))
    tps = [methods[m]["tokens_per_second"] for m in names]
    bars = ax.bar(np.arange(len(names)), tps)
    for bar, m in zip(bars, names):
        ax.annotate(f"{methods[m]['speedup_over_ar']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom")
    ax.set_xticks(np.arange(len(names)))
    ax.set_xticklabels(names, rotation=20, ha="right")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"Decoding speed ({report['backend']}, batch {report['batch_size']})")
    fig.tight_layout()
    p = out_dir / "speed.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(p)
    return paths
