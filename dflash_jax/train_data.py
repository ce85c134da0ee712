"""Training data for DFlash drafters: prompts in, target-generated token files out.

The drafter learns to predict what the TARGET would say, so its training responses are the
target's own generations (not the datasets' reference answers):

  1. prompts come from local JSONL files (gsm8k train `question`, alpaca_eval `instruction`,
     `make-prompts`' code sets); evaluation sets (spec_bench, any `test` split, the held-out
     code set) are refused;
  2. each prompt is wrapped in the target's chat template (`pipeline.encode_prompts`);
  3. the target answers with our own batched, jitted decoding (`evaluate.ar_program`: dense or hybrid), a mix
     of greedy and temperature-1 batches; with `samples_per_prompt` N > 1 every prompt is
     answered N times: copy 0 as above, copies 1..N-1 sampled (a greedy copy would repeat
     copy 0's argmax path token for token);
  4. prompt and response tokens are stored in one `.npz` token file (flat arrays + offsets),
     with the prompt each response answers (`TokenData.prompt_id`), so that a validation
     split can hold out whole prompts (`split_by_prompt`).

Target tap features are NOT stored: the training step recomputes them on the fly with one
causal target forward per batch (`dflash_jax.train.target_taps`, no logits, no backward).
The trade-off, for SmolLM2-135M with a 3-layer drafter (3 taps):
  * caching costs taps x hidden x 2 bytes = 3 x 576 x 2 = 3.4 KB per token in bf16, ~10 GB
    for the ~8k gsm8k + alpaca responses (~3M tokens), written once and read every epoch;
  * recomputing costs ~2 x 107M FLOPs per token (the target without embedding/LM head),
    about as much as the drafter's own forward + backward per packed row (~1.8e8 FLOPs with
    the frozen 49k-vocab head), so at most ~2x step time, and none of the I/O, storage or
    staleness (taps must match the target weights and dtype exactly).
On an H200 a 16 x 512-token step is a few TFLOPs, so on-the-fly is the simple default; for a
large target (8B: 5 x 4096 x 2 = 40 KB per token, and a forward that dwarfs the drafter's)
caching may win. `dflash_jax.train.time_step_parts` measures the split on the device at hand.

At training time the token file becomes fixed-width rows (`SequenceSet`, each row keeping its
prompt id); `split_by_prompt` holds out a seeded fraction of the prompts, with all their
samples, for validation. The order of the training rows is a pure function of (seed, step)
(`batch_indices`), so a resumed run sees exactly the batches an uninterrupted one would.
"""
from __future__ import annotations

import dataclasses
import json
import time
import zipfile
from pathlib import Path
from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.files import atomic_write_text
from dflash_jax.jsonl import file_and_limit, iter_jsonl
from dflash_jax.sampling import SamplingParams

FORMAT = "dflash-jax/train-tokens"
VERSION = 1
# Fields read from a JSONL row, in order of preference.
PROMPT_FIELDS = ("question", "instruction", "prompt")


class EvaluationDataError(ValueError):
    """A training prompt file is an evaluation set (spec_bench, a test split)."""


# ----------------------------------------------------------------------------- prompts

def default_sources(data_dir: str | Path) -> list[Path]:
    """The training prompt files of `../shared/data` (see its README)."""
    data_dir = Path(data_dir)
    return [data_dir / "gsm8k" / "train.jsonl", data_dir / "alpaca_eval" / "instructions.jsonl"]


def check_training_source(path: str | Path) -> None:
    """Raises EvaluationDataError when `path` names an evaluation set.

    Refused: anything under a spec_bench / mt_bench folder, any file whose name starts with
    `test` (e.g. gsm8k's test.jsonl) and any whose name says held out (`make-prompts`'
    code_heldout.jsonl). These sets measure the drafter; training on them would inflate every
    reported acceptance length.
    """
    p = Path(path)
    if "heldout" in p.name.lower().replace("_", "").replace("-", ""):
        raise EvaluationDataError(f"{path}: a held-out set (e.g. make-prompts' code_heldout.jsonl) is for "
                                  f"evaluation; it may not be used for drafter training (use "
                                  f"code_stdlib_train.jsonl)")
    parts = [s.lower().replace("-", "_") for s in p.resolve().parts]
    for bench in ("spec_bench", "mt_bench"):
        if any(bench in s for s in parts):
            raise EvaluationDataError(f"{path}: {bench} is an evaluation set; it may not be used for "
                                      f"drafter training (use gsm8k/train.jsonl, alpaca_eval)")
    if p.name.lower().startswith("test"):
        raise EvaluationDataError(f"{path}: a test split is for evaluation; it may not be used for "
                                  f"drafter training (use the train split)")


def read_prompts(path: str | Path, limit: int | None = None, field: str | None = None,
                 math_suffix: str = "never") -> list[str]:
    """Prompt texts from a JSONL training file (field `question`, `instruction` or `prompt`).

    Refuses evaluation sets by path (`check_training_source`) and by content: rows with
    spec_bench's multi-turn `turns` field, and code rows of a held-out stdlib module
    (`prompt_sets.HELDOUT_MODULES`). `math_suffix` as in evaluation
    (`evaluate.with_math_suffix`): "auto" suffixes math rows (`question` + `answer`, as gsm8k).
    """
    from dflash_jax.evaluate import check_math_suffix, with_math_suffix
    from dflash_jax.prompt_sets import HELDOUT_MODULES

    check_math_suffix(math_suffix)
    check_training_source(path)
    out: list[str] = []
    for line_no, row in iter_jsonl(path):
        if "turns" in row:
            raise EvaluationDataError(f"{path}:{line_no}: a row with 'turns' looks like spec_bench, "
                                      f"an evaluation set; refusing to train on it")
        if row.get("category") == "code" and row.get("module") in HELDOUT_MODULES:
            raise EvaluationDataError(f"{path}:{line_no}: {row.get('source')} is in the held-out code set "
                                      f"(module {row['module']}); refusing to train on it")
        key = field or next((k for k in PROMPT_FIELDS if k in row), None)
        if key is None or not isinstance(row.get(key), str):
            raise ValueError(f"{path}:{line_no}: no prompt field (expected one of {PROMPT_FIELDS})")
        out.append(with_math_suffix(row[key], key == "question" and "answer" in row, math_suffix))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


# ----------------------------------------------------------------------------- token files

@dataclasses.dataclass
class TokenData:
    """Prompts and target responses, as flat int32 arrays with offsets (row i = [off[i], off[i+1]))."""

    prompt_tokens: np.ndarray
    prompt_offsets: np.ndarray
    response_tokens: np.ndarray
    response_offsets: np.ndarray
    temperature: np.ndarray  # [n] float32, the sampling temperature of each response (0 = greedy)
    source: np.ndarray  # [n] int32 index into meta["sources"]
    meta: dict[str, Any]
    # [n] int32: which prompt each response answers (rows of one prompt share it). None (a file
    # written before samples_per_prompt existed) = every row its own prompt.
    prompt_id: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self)
        if self.prompt_id is None:
            self.prompt_id = np.arange(n, dtype=np.int32)
        self.prompt_id = np.asarray(self.prompt_id, np.int32)
        if self.prompt_id.shape != (n,):
            raise ValueError(f"prompt_id has shape {self.prompt_id.shape}, expected ({n},)")

    def __len__(self) -> int:
        return len(self.prompt_offsets) - 1

    def prompt(self, i: int) -> np.ndarray:
        return self.prompt_tokens[self.prompt_offsets[i]:self.prompt_offsets[i + 1]]

    def response(self, i: int) -> np.ndarray:
        return self.response_tokens[self.response_offsets[i]:self.response_offsets[i + 1]]

    @classmethod
    def from_lists(cls, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                   temperature: Sequence[float], source: Sequence[int], meta: dict[str, Any],
                   prompt_id: Sequence[int] | None = None) -> "TokenData":
        if not len(prompts) == len(responses) == len(temperature) == len(source):
            raise ValueError("prompts, responses, temperature and source differ in length")
        if prompt_id is not None and len(prompt_id) != len(prompts):
            raise ValueError("prompt_id and prompts differ in length")

        def flat(rows):
            offsets = np.zeros(len(rows) + 1, np.int64)
            offsets[1:] = np.cumsum([len(r) for r in rows])
            tokens = np.concatenate([np.asarray(r, np.int32) for r in rows]) if rows else np.zeros(0, np.int32)
            return tokens.astype(np.int32), offsets

        pt, po = flat(prompts)
        rt, ro = flat(responses)
        return cls(pt, po, rt, ro, np.asarray(temperature, np.float32), np.asarray(source, np.int32), dict(meta),
                   None if prompt_id is None else np.asarray(prompt_id, np.int32))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, prompt_tokens=self.prompt_tokens, prompt_offsets=self.prompt_offsets,
                 response_tokens=self.response_tokens, response_offsets=self.response_offsets,
                 temperature=self.temperature, source=self.source, prompt_id=self.prompt_id,
                 meta=np.array(json.dumps({"format": FORMAT, "version": VERSION, **self.meta})))
        tmp.replace(path)  # never leave a half-written token file under the real name
        return path

    @classmethod
    def load(cls, path: str | Path) -> "TokenData":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: token file not found (make it with `dflash-jax make-data`)")
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                if meta.get("format") != FORMAT or meta.get("version") != VERSION:
                    raise ValueError(f"{path}: format {meta.get('format')!r} version {meta.get('version')!r} "
                                     f"is not {FORMAT!r} version {VERSION}")
                # Files written before samples_per_prompt have no prompt_id: one prompt per row.
                prompt_id = z["prompt_id"] if "prompt_id" in z.files else None
                data = cls(z["prompt_tokens"], z["prompt_offsets"], z["response_tokens"], z["response_offsets"],
                           z["temperature"], z["source"], meta, prompt_id)
        except ValueError as err:
            if str(path) in str(err):
                raise
            raise ValueError(f"{path}: not a readable token file ({err}); remake it with `dflash-jax make-data`"
                             ) from None
        except (zipfile.BadZipFile, EOFError, KeyError, OSError) as err:
            # A truncated or overwritten .npz: zipfile, numpy and the key lookups each fail their own way.
            raise ValueError(f"{path}: not a readable token file ({type(err).__name__}: {err}); remake it "
                             f"with `dflash-jax make-data`") from None
        data.check(str(path))
        return data

    def check(self, source: str) -> None:
        """Offsets that cut the flat arrays into rows, one temperature and source per row."""
        n = len(self)
        for name, offsets, tokens in (("prompt", self.prompt_offsets, self.prompt_tokens),
                                      ("response", self.response_offsets, self.response_tokens)):
            if (offsets.ndim != 1 or n < 0 or offsets[0] != 0 or offsets[-1] != len(tokens)
                    or (np.diff(offsets) < 0).any()):
                raise ValueError(f"{source}: {name}_offsets do not cut {name}_tokens ({len(tokens)} tokens) "
                                 f"into rows; remake it with `dflash-jax make-data`")
        if len(self.response_offsets) != n + 1 or self.temperature.shape != (n,) or self.source.shape != (n,):
            raise ValueError(f"{source}: its arrays disagree on the number of rows ({n}); remake it with "
                             f"`dflash-jax make-data`")


# ----------------------------------------------------------------------------- generation

def check_samples(samples_per_prompt: int, temperature: float) -> None:
    """Refuses fewer than one response per prompt, and several greedy ones (all identical)."""
    if samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt (--samples-per-prompt) must be >= 1, got {samples_per_prompt}")
    if samples_per_prompt > 1 and temperature <= 0:
        raise ValueError(f"samples_per_prompt (--samples-per-prompt) {samples_per_prompt} needs a sampling "
                         f"temperature > 0 (--gen-temperature), got {temperature}: greedy copies would all "
                         f"be the same response")


def generate_responses(params: Any, cfg: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                       batch_size: int = 32, sample_fraction: float = 0.5, temperature: float = 1.0,
                       samples_per_prompt: int = 1, stop_tokens: tuple[int, ...] = (), seed: int = 0,
                       progress: bool = True) -> tuple[list[list[int]], list[float]]:
    """Target responses for token prompts with our batched AR decoding -> (responses, temperatures).

    Prompts are sorted by length and decoded `batch_size` at a time (one compiled program per
    sampling mode: every batch is padded to the longest prompt). Each batch is greedy or sampled
    at `temperature` (a seeded draw with probability `sample_fraction`), so the drafter sees both
    the target's argmax paths and its sampled ones. A response ends with its stop token when one
    was produced.

    With `samples_per_prompt` N > 1 the prompts are answered N times, copy-major: entry
    c * len(prompts) + i is copy c of prompt i. Copy 0 is the greedy / sampled mix above (the
    same responses as N = 1); copies 1..N-1 are all sampled at `temperature`, batch b of copy c
    with its own key (key b of copy 0 folded with c), so no two copies share a random stream.

    In a multi-process run (`dflash_jax.distributed`) process p decodes batches p, p + N, ... of
    that list on its own first device, and every process ends with every response: the same
    responses as one process.
    """
    from dflash_jax import distributed as dist
    from dflash_jax.evaluate import ar_program
    from dflash_jax.generate import check_prompts
    from dflash_jax.pipeline import default_max_len, pad_prompts, padded_width

    if not prompts:
        raise ValueError("no prompts")
    if not 0.0 <= sample_fraction <= 1.0:
        raise ValueError(f"sample_fraction must be in [0, 1], got {sample_fraction}")
    check_samples(samples_per_prompt, temperature)
    n = len(prompts)
    order = np.argsort([len(p) for p in prompts], kind="stable")
    rng = np.random.default_rng(seed)
    responses: list[list[int]] = [[] for _ in range(n * samples_per_prompt)]
    temps = [0.0] * (n * samples_per_prompt)
    batches = [order[i:i + batch_size] for i in range(0, n, batch_size)]
    # Every batch padded to the longest prompt: one compiled program for the whole run (on a GPU
    # a compile costs far more than the padded prefill rows).
    width = padded_width(prompts, 32)
    max_len = default_max_len(width, max_new_tokens, 1)
    # A batch of the longest prompt is the largest case: positions and cache memory.
    check_prompts(np.full(batch_size, max(len(p) for p in prompts), np.int32), width, max_new_tokens, max_len,
                  cfg=cfg,
                  itemsize=int(np.dtype(jax.tree.leaves(params)[0].dtype).itemsize))
    generate, extra = ar_program(cfg)  # dense or hybrid target
    # Every job's sampling mode is drawn in every process, in order: the seeded stream stays one.
    jobs = []
    for copy in range(samples_per_prompt):
        for b in range(len(batches)):
            sampled = bool(rng.random() < sample_fraction) if copy == 0 else True
            jobs.append((copy, b, sampled))

    def run(copy: int, b: int, sampled: bool) -> dict[str, Any]:
        idx = batches[b]
        chunk = [list(prompts[i]) for i in idx]
        chunk += [chunk[-1]] * (batch_size - len(chunk))  # one compiled batch shape
        arr, lens = pad_prompts(chunk, width=width)
        key = jax.random.key(seed * 100003 + b)
        if copy:
            key = jax.random.fold_in(key, copy)
        sp = SamplingParams(temperature=temperature) if sampled else SamplingParams()
        gen = generate(params, cfg, jnp.asarray(arr), jnp.asarray(lens), key,
                       max_new_tokens=max_new_tokens, max_len=max_len, sampling=sp,
                       stop_tokens=tuple(stop_tokens), **extra)
        toks, num = np.asarray(gen.tokens), np.asarray(gen.num_tokens)
        return {"rows": [copy * n + int(i) for i in idx], "temperature": sp.temperature,
                "tokens": [toks[row, :num[row]].tolist() for row in range(len(idx))]}

    procs, me = jax.process_count(), jax.process_index()
    bar = _progress(n * samples_per_prompt, "generate", progress and dist.is_main())
    for first in range(0, len(jobs), procs):
        mine = [run(*jobs[first + me])] if first + me < len(jobs) else []
        for done in (dist.gather_json(mine) if procs > 1 else mine):
            for r, toks in zip(done["rows"], done["tokens"]):
                responses[r], temps[r] = toks, done["temperature"]
            bar.update(len(done["rows"]))
    bar.close()
    return responses, temps


def make_token_data(params: Any, cfg: Any, tokenizer: Any, sources: Iterable[str | Path], *,
                    max_new_tokens: int = 256, max_prompt_tokens: int = 256, limit: int | None = None,
                    batch_size: int = 32, sample_fraction: float = 0.5, temperature: float = 1.0,
                    samples_per_prompt: int = 1, seed: int = 0, target_name: str = "",
                    math_suffix: str = "auto", progress: bool = True) -> TokenData:
    """Reads prompts, wraps them in the chat template, lets the target answer -> TokenData.

    Prompts longer than `max_prompt_tokens` after templating are skipped (counted in meta).
    `limit` caps the prompts read per source file; a source "FILE:N" reads at most N of FILE's
    (`jsonl.file_and_limit`), so one command can weigh the files of a mix. Each prompt is answered `samples_per_prompt`
    times (see `generate_responses`); row c * P + i is copy c of prompt i, and
    `prompt_id[c * P + i] = i`. Math prompts get the suffix that evaluation gives them
    (`math_suffix`, see `evaluate.with_math_suffix`): the drafter then learns the kind of
    response that it will be asked to draft.
    """
    from dflash_jax.pipeline import encode_prompts, stop_tokens_for

    check_samples(samples_per_prompt, temperature)  # before any model work
    specs = [str(s) for s in sources]
    limited = [file_and_limit(s) for s in specs]
    for path, _ in limited:
        check_training_source(path)  # refuse before any generation work
    prompts: list[list[int]] = []
    source_of: list[int] = []
    skipped = 0
    for si, (src, cap) in enumerate(limited):
        cap = cap if limit is None else limit if cap is None else min(cap, limit)
        for ids in encode_prompts(tokenizer, read_prompts(src, limit=cap, math_suffix=math_suffix)):
            if len(ids) > max_prompt_tokens:
                skipped += 1
                continue
            prompts.append(ids)
            source_of.append(si)
    if not prompts:
        raise ValueError(f"every prompt is longer than max_prompt_tokens={max_prompt_tokens}")
    stop = stop_tokens_for(tokenizer, cfg)
    t0 = time.perf_counter()
    responses, temps = generate_responses(params, cfg, prompts, max_new_tokens=max_new_tokens,
                                          batch_size=batch_size, sample_fraction=sample_fraction,
                                          temperature=temperature, samples_per_prompt=samples_per_prompt,
                                          stop_tokens=stop, seed=seed, progress=progress)
    meta = {"sources": specs, "target": target_name, "max_new_tokens": max_new_tokens,
            "max_prompt_tokens": max_prompt_tokens, "skipped_long_prompts": skipped,
            "sample_fraction": sample_fraction, "temperature": temperature,
            "samples_per_prompt": samples_per_prompt, "prompts": len(prompts), "seed": seed,
            "math_suffix": math_suffix,
            "stop_tokens": list(stop), "generate_seconds": time.perf_counter() - t0}
    copies = samples_per_prompt
    return TokenData.from_lists(prompts * copies, responses, temps, source_of * copies, meta,
                                prompt_id=list(range(len(prompts))) * copies)


# ----------------------------------------------------------------------------- training rows

@dataclasses.dataclass
class SequenceSet:
    """Fixed-width training rows: tokens [n, seq_len] = prompt + response (+ pad), and lengths.

    Anchors are drawn in [prompt_lens, total_lens - 2] (see `train.sample_anchors`), so every
    row has at least 2 response tokens.
    """

    tokens: np.ndarray  # [n, seq_len] int32
    prompt_lens: np.ndarray  # [n] int32
    total_lens: np.ndarray  # [n] int32, prompt + (truncated) response
    prompt_ids: np.ndarray | None = None  # [n] int32, the prompt of each row (None: one prompt per row)

    def __post_init__(self) -> None:
        if self.prompt_ids is None:
            self.prompt_ids = np.arange(len(self), dtype=np.int32)
        if np.shape(self.prompt_ids) != (len(self),):
            raise ValueError(f"prompt_ids has shape {np.shape(self.prompt_ids)}, expected ({len(self)},)")

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    def batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        return {"tokens": self.tokens[indices], "prompt_lens": self.prompt_lens[indices],
                "total_lens": self.total_lens[indices]}


def build_sequences(data: TokenData, seq_len: int, pad_id: int = 0, min_response: int = 2) -> SequenceSet:
    """Prompt + response per row, responses cut at `seq_len`; rows with < min_response tokens dropped."""
    if min_response < 2:
        raise ValueError("min_response must be >= 2 (an anchor needs a next token)")
    rows, plens, tlens, pids = [], [], [], []
    for i in range(len(data)):
        p, r = data.prompt(i), data.response(i)
        room = seq_len - len(p)
        if room < min_response or len(r) < min_response:
            continue
        r = r[:room]
        row = np.full(seq_len, pad_id, np.int32)
        row[:len(p)] = p
        row[len(p):len(p) + len(r)] = r
        rows.append(row)
        plens.append(len(p))
        tlens.append(len(p) + len(r))
        pids.append(data.prompt_id[i])
    if not rows:
        raise ValueError(f"no usable training rows: every prompt is longer than seq_len={seq_len} - "
                         f"{min_response} or every response is shorter than {min_response} tokens")
    return SequenceSet(np.stack(rows), np.asarray(plens, np.int32), np.asarray(tlens, np.int32),
                       np.asarray(pids, np.int32))


# Stream of the validation split's generator, apart from the data order's ([seed, epoch]).
_SPLIT_STREAM = 0x5B117


def split_by_prompt(prompt_ids: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Holds out whole prompts for validation -> (train rows, validation rows), ascending indices.

    round(fraction x distinct prompts) prompts, drawn by a generator seeded with `seed`, go to
    validation with every row (sample) they have, so the drafter is validated on prompts it
    never trained on. fraction 0 = no validation rows. A fraction that holds out no prompt, or
    every prompt, is refused.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"val_fraction (--val-fraction) must be in [0, 1), got {fraction}")
    prompt_ids = np.asarray(prompt_ids)
    rows = np.arange(len(prompt_ids))
    if fraction == 0.0:
        return rows, rows[:0]
    prompts = np.unique(prompt_ids)
    held = int(np.floor(fraction * len(prompts) + 0.5))
    if held == 0:
        raise ValueError(f"val_fraction (--val-fraction) {fraction} of {len(prompts)} prompts holds out no "
                         f"prompt: no validation rows; use a larger fraction, or 0 to turn validation off")
    if held >= len(prompts):
        raise ValueError(f"val_fraction (--val-fraction) {fraction} of {len(prompts)} prompts holds out every "
                         f"prompt: no training rows; use a smaller fraction")
    val_prompts = np.random.default_rng([seed, _SPLIT_STREAM]).permutation(prompts)[:held]
    is_val = np.isin(prompt_ids, val_prompts)
    return rows[~is_val], rows[is_val]


def batch_indices(num_rows: int, batch_size: int, step: int, seed: int) -> np.ndarray:
    """Row indices of training step `step`: a fresh seeded permutation per epoch, read in order.

    A pure function of (seed, step): resuming at step s reproduces the uninterrupted order.
    """
    start = step * batch_size
    out = np.empty(batch_size, np.int64)
    for j in range(batch_size):
        epoch, pos = divmod(start + j, num_rows)
        out[j] = _epoch_permutation(num_rows, seed, epoch)[pos]
    return out


_PERM_CACHE: dict[tuple[int, int, int], np.ndarray] = {}


def _epoch_permutation(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    key = (num_rows, seed, epoch)
    if key not in _PERM_CACHE:
        if len(_PERM_CACHE) > 4:
            _PERM_CACHE.clear()
        _PERM_CACHE[key] = np.random.default_rng([seed, epoch]).permutation(num_rows)
    return _PERM_CACHE[key]


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, unit="seq")


# ----------------------------------------------------------------------------- taps on disk

TAPS_FILE, TAPS_META = "taps.bin", "taps.json"


@dataclasses.dataclass
class TapStore:
    """The target's tap features of every training row, written once and read back by rows.

    One raw file, `taps.bin`, of [rows, seq_len, features] in `dtype` (a memory map: a batch
    reads only its rows), and `taps.json` with the shape, dtype and the tap layers they came from.
    Costs features x itemsize bytes per token on disk (Qwen3.6-27B, 5 taps of 5120 in bf16: 51 KB).
    `complete` turns true once every row is written (`mark_complete`): `create` makes the whole
    file of zeros first, so a writer stopped halfway leaves a file of the right size whose missing
    rows would read as zeros.
    """

    path: Path
    rows: int
    seq_len: int
    features: int
    dtype: str
    tap_layers: tuple[int, ...]
    complete: bool = True

    @classmethod
    def create(cls, directory: str | Path, rows: int, seq_len: int, features: int, dtype: str,
               tap_layers: Sequence[int]) -> "TapStore":
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        store = cls(directory, rows, seq_len, features, str(jnp.dtype(dtype)), tuple(int(t) for t in tap_layers),
                    complete=False)
        np.memmap(directory / TAPS_FILE, dtype=jnp.dtype(dtype), mode="w+", shape=store.shape).flush()
        store._write_meta()
        return store

    def _write_meta(self) -> None:
        atomic_write_text(self.path / TAPS_META, json.dumps({
            "rows": self.rows, "seq_len": self.seq_len, "features": self.features, "dtype": self.dtype,
            "tap_layers": list(self.tap_layers), "complete": self.complete}))

    def mark_complete(self) -> None:
        """Records that every row is written (after the last `write`)."""
        self.complete = True
        self._write_meta()

    @classmethod
    def open(cls, directory: str | Path) -> "TapStore":
        directory = Path(directory)
        meta_path = directory / TAPS_META
        try:
            meta = json.loads(meta_path.read_text())
            # A record without "complete" predates the flag; it was written whole or not at all.
            store = cls(directory, int(meta["rows"]), int(meta["seq_len"]), int(meta["features"]), str(meta["dtype"]),
                        tuple(int(t) for t in meta["tap_layers"]), complete=bool(meta.get("complete", True)))
        except FileNotFoundError:
            raise FileNotFoundError(f"{meta_path}: no taps here (make-taps writes them)") from None
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{meta_path}: not a taps record ({type(err).__name__}: {err})") from None
        need = int(np.prod(store.shape)) * jnp.dtype(store.dtype).itemsize
        have = (directory / TAPS_FILE).stat().st_size if (directory / TAPS_FILE).is_file() else -1
        if have != need:
            raise ValueError(f"{directory / TAPS_FILE}: {have} bytes, {meta_path} says {store.shape} "
                             f"{store.dtype} = {need} bytes")
        return store

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.rows, self.seq_len, self.features)

    def _map(self, mode: str) -> np.memmap:
        return np.memmap(self.path / TAPS_FILE, dtype=jnp.dtype(self.dtype), mode=mode, shape=self.shape)

    def write(self, start: int, taps: np.ndarray) -> None:
        """Rows start .. start + len(taps) - 1."""
        m = self._map("r+")
        m[start:start + len(taps)] = np.asarray(taps, dtype=m.dtype)
        m.flush()

    def read(self, indices: np.ndarray) -> np.ndarray:
        """[len(indices), seq_len, features] (a copy: the rows are read from disk or page cache here)."""
        return np.asarray(self._map("r")[np.asarray(indices)])
