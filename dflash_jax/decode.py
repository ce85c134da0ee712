"""Decoding a JSONL file of prompts into a JSONL file of answers: batched, bucketed, resumable.

Prompts are grouped by padded length (a bucket); each bucket is cut into batches of a fixed size,
the last one filled up with copies of its last prompt, so every bucket compiles one program.
Answers are appended and flushed as each batch finishes, so a killed run keeps every finished
batch, and a rerun skips the ids already in the output.

In a multi-process run (`dflash_jax.distributed`) every process reads the whole input and makes
the same list of batches; process p decodes batches p, p + N, p + 2N, ... on its own first
device, and after each round of N batches process 0 gathers the answers and writes them: one
writer, every row once, the same answers as one process (each batch keeps its own key).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from dflash_jax import distributed as dist
from dflash_jax import pipeline
from dflash_jax.generate import Generation, generate_ar
from dflash_jax.jsonl import iter_jsonl
from dflash_jax.mtp import MTPConfig
from dflash_jax.sampling import SamplingParams

METHODS = ("ar", "dflash", "ddtree", "mtp")
BUCKET_MULTIPLE = 32  # prompt widths are rounded up to this: fewer buckets, fewer programs


@dataclasses.dataclass(frozen=True)
class PromptRow:
    line: int  # 1-based line number in the input file
    id: Any  # the row's "id", else its line number
    row: dict[str, Any]
    text: str


def prompt_text(row: dict[str, Any], where: str) -> str:
    """The prompt of an input row: "prompt", "question", "instruction" (alpaca's and make-prompts'
    files), or the first of "turns"."""
    text = row.get("prompt", row.get("question", row.get("instruction")))
    if text is None and isinstance(row.get("turns"), list) and row["turns"]:
        text = row["turns"][0]
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}: no prompt (expected a non-empty 'prompt', 'question', 'instruction' or 'turns' "
                         f"string)")
    return text


def read_prompts(path: str | Path) -> list[PromptRow]:
    """Every row of the input, checked before any decoding; a bad line is named by its number."""
    rows, seen = [], {}
    for line_no, row in iter_jsonl(path):
        where = f"{path}:{line_no}"
        rid = row.get("id", line_no)
        if not isinstance(rid, (str, int)) or isinstance(rid, bool):
            raise ValueError(f"{where}: 'id' must be a string or an integer, got {rid!r}")
        if rid in seen:
            raise ValueError(f"{where}: id {rid!r} repeats line {seen[rid]}")
        seen[rid] = line_no
        rows.append(PromptRow(line_no, rid, row, prompt_text(row, where)))
    return rows


def finished_ids(path: str | Path, repair: bool = True) -> set[Any]:
    """Ids already answered in `path`; a torn last line (a run killed mid-write) is cut off first
    (unless not `repair`: only the writing process may), so the rerun writes that row again whole
    instead of after a broken line."""
    path = Path(path)
    if not path.exists():
        return set()
    data = path.read_bytes()
    done, good_end, pos = set(), 0, 0
    for line in data.splitlines(keepends=True):
        pos += len(line)
        if not line.strip():
            good_end = pos
            continue
        try:
            row = json.loads(line)
        except ValueError:
            if pos < len(data):
                line_no = data[:pos].count(b"\n")
                raise ValueError(f"{path}: line {line_no} is not JSON; the output file is "
                                 f"damaged beyond its last line, fix or move it") from None
            break
        if not line.endswith(b"\n"):
            break  # complete JSON without its newline: written again whole below
        done.add(row["id"])
        good_end = pos
    if good_end < len(data) and repair:
        with path.open("r+b") as f:
            f.truncate(good_end)
    return done


def buckets(token_lists: Sequence[Sequence[int]], batch: int, multiple: int = BUCKET_MULTIPLE
            ) -> list[tuple[int, list[int]]]:
    """-> [(width, indices of at most `batch` prompts)], widths ascending; one program per width."""
    by_width: dict[int, list[int]] = {}
    for i, toks in enumerate(token_lists):
        by_width.setdefault(pipeline.padded_width([toks], multiple), []).append(i)
    return [(w, idx[s:s + batch]) for w, idx in sorted(by_width.items()) for s in range(0, len(idx), batch)]


def decode_file(params: Any, cfg: Any, tokenizer: Any, input_path: str | Path, output_path: str | Path, *,
                method: str = "ar", dparams: Any = None, dcfg: Any = None, budget: int = 64, mtp_steps: int = 3,
                mtp_budget: int = 0, batch: int = 8, max_new_tokens: int = 128,
                sampling: SamplingParams = SamplingParams(), seed: int = 0, chat: bool = True, progress: bool = True,
                on_batch: Callable[[list[dict[str, Any]]], None] | None = None) -> dict[str, Any]:
    """Decodes every prompt of `input_path` not yet answered in `output_path` (appended to).

    method: "ar", "dflash" / "ddtree" (dparams, dcfg: a DFlash drafter; budget: DDTree's nodes) or
    "mtp" (dparams, dcfg: `mtp.MTPParams`, `mtp.MTPConfig`; mtp_steps chained head steps per
    round, verified as a chain, or as a tree of mtp_budget nodes when mtp_budget > 0).
    Each output row is the input row plus "text", "num_tokens", "tau" (tokens per round; None
    for ar), "rounds" and "seconds" (the batch's decode time, compile excluded).
    -> {"decoded", "skipped", "tokens", "seconds", "compile_seconds", "programs"}.
    on_batch: called (in the writing process) with each batch's rows after they are written.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method != "ar" and (dparams is None or dcfg is None):
        raise ValueError(f"method {method} needs a drafter (dparams, dcfg)")
    if method == "mtp" and not isinstance(dcfg, MTPConfig):
        raise ValueError(f"method mtp needs an MTP head: dcfg must be an mtp.MTPConfig, got {type(dcfg).__name__}")
    if method in ("dflash", "ddtree") and isinstance(dcfg, MTPConfig):
        raise ValueError(f"method {method} needs a DFlash drafter; dcfg is an MTP head's (use method 'mtp')")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    rows = read_prompts(input_path)  # every line checked before anything is decoded or written
    main = dist.is_main()
    done = finished_ids(output_path, repair=main)
    todo = [r for r in rows if r.id not in done]
    stop = pipeline.stop_tokens_for(tokenizer, cfg)
    token_lists = pipeline.encode_prompts(tokenizer, [r.text for r in todo], chat=chat) if todo else []
    settings = None
    if method != "ar":
        from dflash_jax.speculative import SpecSettings, speculative_program

        if method == "mtp":
            settings = SpecSettings(method="mtp", mtp_steps=mtp_steps, budget=mtp_budget, sampling=sampling,
                                    max_new_tokens=max_new_tokens, stop_tokens=stop)
        else:
            settings = SpecSettings(method=method, block_size=dcfg.block_size,
                                    budget=budget if method == "ddtree" else 0, sampling=sampling,
                                    max_new_tokens=max_new_tokens, stop_tokens=stop)
        program = speculative_program(settings)
    else:
        # A Qwen3.5 / Qwen3.6 hybrid decodes AR with its own loop; its speculative rounds share
        # `speculative_program` with dense targets.
        from dflash_jax import qwen3_5 as q35

        ar_program = q35.generate if isinstance(cfg, q35.Qwen35Config) else generate_ar
    compiled = pipeline.Compiled()
    key = jax.random.key(seed)

    def decode_batch(width: int, idx: list[int]) -> dict[str, Any]:
        """One batch -> {"rows": answers, "seconds", "committed", "rounds"} (JSON: it may cross processes)."""
        lists = [token_lists[i] for i in idx]
        lists += [lists[-1]] * (batch - len(lists))  # one shape per bucket
        prompts, lens = pipeline.pad_prompts(lists, width=width)
        sub = jax.random.fold_in(key, todo[idx[0]].line)  # the same key for this batch on a rerun
        if settings is None:
            max_len = pipeline.default_max_len(width, max_new_tokens, 1)
            result, secs = compiled.run(width, ar_program, (params, cfg, jnp.asarray(prompts), jnp.asarray(lens), sub),
                                        dict(max_new_tokens=max_new_tokens, max_len=max_len,
                                             sampling=sampling, stop_tokens=stop))
            if isinstance(result, tuple):  # a hybrid's AR gives (tokens, num_tokens)
                result = Generation(*result)
        else:
            max_len = pipeline.default_max_len(width, max_new_tokens, settings.cache_slack())
            result, secs = compiled.run(width, program, (params, cfg, dparams, dcfg, jnp.asarray(prompts),
                                                         jnp.asarray(lens), sub),
                                        dict(settings=settings, max_len=max_len))
        timed = pipeline.TimedGeneration(result, secs, 0.0)
        toks = timed.token_lists()
        acc = timed.acceptance()
        out = {"rows": [], "seconds": secs, "committed": 0, "rounds": 0}
        for j, i in enumerate(idx):
            r = todo[i]
            rounds = int(acc["rounds"][j]) if acc else None
            tau = (sum(acc["accepted_per_round"][j]) / max(rounds, 1)) if acc else None
            out["rows"].append({**r.row, "id": r.id, "text": tokenizer.decode(toks[j], skip_special_tokens=True),
                                "num_tokens": len(toks[j]), "tau": tau, "rounds": rounds, "seconds": secs})
            if acc:
                out["committed"] += int(sum(acc["accepted_per_round"][j]))
                out["rounds"] += rounds
        return out

    batches = buckets(token_lists, batch)
    procs, me = jax.process_count(), jax.process_index()
    bar = _progress(len(todo), progress and main)
    totals = {"decoded": 0, "skipped": len(rows) - len(todo), "tokens": 0, "seconds": 0.0}
    committed = rounds_total = 0
    with (Path(output_path).open("a", encoding="utf-8") if main else contextlib.nullcontext()) as out:
        for first in range(0, len(batches), procs):
            mine = first + me
            finished = [decode_batch(*batches[mine])] if mine < len(batches) else []
            # This round's batches, in batch order, in every process; process 0 writes them.
            for b in (dist.gather_json(finished) if procs > 1 else finished):
                if not main:
                    continue
                for answer in b["rows"]:
                    out.write(json.dumps(answer) + "\n")
                out.flush()
                totals["decoded"] += len(b["rows"])
                totals["tokens"] += sum(a["num_tokens"] for a in b["rows"])
                totals["seconds"] += b["seconds"]
                committed += b["committed"]
                rounds_total += b["rounds"]
                if on_batch is not None:
                    on_batch(b["rows"])
                bar.update(len(b["rows"]))
                post = {"tok/s": f"{totals['tokens'] / max(totals['seconds'], 1e-9):.1f}"}
                if rounds_total:
                    post["tau"] = f"{committed / rounds_total:.2f}"
                bar.set_postfix(post)
    bar.close()
    return {**totals, "compile_seconds": compiled.compile_seconds, "programs": len(compiled.programs),
            "tau": committed / rounds_total if rounds_total else None}


def _progress(total: int, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="prompts", unit="prompt", file=sys.stderr, disable=not enabled)
