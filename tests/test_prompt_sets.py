"""The offline prompt sets (dflash_jax.prompt_sets): stdlib tasks split by module, seed topics,
long-context tasks over the stdlib's prose, and the data card's counts against what the
generator writes."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from dflash_jax import prompt_sets as ps
from dflash_jax.cli import main
from dflash_jax.evaluate import load_bench_prompts
from dflash_jax.jsonl import file_and_limit
from dflash_jax.train_data import EvaluationDataError, read_prompts

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT / ".." / "shared" / "data"
CARD = ROOT / "dflash_jax" / "drafters" / "DATA.md"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("prompts")
    assert main(["make-prompts", "--out", str(out)]) == 0
    return out, json.loads((out / ps.META_FILE).read_text())


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def sample_function(text, width=70, *, indent=""):
    """Wrap a paragraph of text into lines of at most width characters.

    Words longer than width stay whole on their own line.
    """


def test_task_text_is_the_signature_and_docstring():
    assert ps._task_text(sample_function, "sample_function") == (
        '```python\n'
        'def sample_function(text, width=70, *, indent=\'\'):\n'
        '    """Wrap a paragraph of text into lines of at most width characters.\n'
        '\n'
        '    Words longer than width stay whole on their own line.\n'
        '    """\n'
        '```')
    assert ps._task_text(len, "len") is None  # a C function: no source to learn from
    assert ps._task_text(rows_of, "rows_of") is None  # no docstring


def test_stdlib_split_keeps_held_out_modules_apart(built):
    out, meta = built
    train, held = rows_of(out / "code_stdlib_train.jsonl"), rows_of(out / "code_heldout.jsonl")
    assert len(train) == meta["rows"]["code_stdlib_train.jsonl"] and len(held) == meta["rows"]["code_heldout.jsonl"]
    assert len(train) > 500 and len(held) > 100
    assert {r["module"] for r in held} == set(meta["heldout_modules"]) == set(ps.HELDOUT_MODULES)
    assert not {r["module"] for r in train} & set(ps.HELDOUT_MODULES)
    # No function's text on both sides, and no function twice.
    blocks = lambda rows: {r["instruction"].split("\n\n", 1)[1] for r in rows}  # noqa: E731
    assert not blocks(train) & blocks(held)
    sources = [r["source"] for r in train + held]
    assert len(set(sources)) == len(sources)
    for r in train + held:
        assert r["category"] == "code" and r["source"].startswith(r["module"] + ".")
        head = r["instruction"].split("\n\n", 1)[0]
        name = r["source"][len(r["module"]) + 1:]
        if "." in name:  # a method, under every instruction: its class is named
            assert f"method of the Python class `{name.split('.')[0]}`" in head, head
        else:
            assert head in ps.STDLIB_INSTRUCTIONS, head
        assert "```python\n" in r["instruction"] and " at 0x" not in r["instruction"]
    # A prefix of the file mixes modules (CRC-32 order), so `FILE:N` is a fair sample.
    assert len({r["module"] for r in held[:20]}) >= 5
    assert "statistics.median" in sources and "textwrap.dedent" in sources


def test_prompt_files_are_the_same_on_every_build(built, tmp_path):
    out, _ = built
    ps.build(tmp_path)
    for name in ("code_stdlib_train.jsonl", "code_heldout.jsonl", "code_topics.jsonl", ps.META_FILE):
        assert (tmp_path / name).read_bytes() == (out / name).read_bytes(), name


def test_topics(built):
    out, meta = built
    rows = rows_of(out / "code_topics.jsonl")
    n = len(ps.TOPICS)
    assert len(set(ps.TOPICS)) == n and f"{n} seed programming topics" in CARD.read_text()
    assert len(rows) == meta["rows"]["code_topics.jsonl"] == n * len(ps.TOPIC_INSTRUCTIONS)
    assert {r["instruction"] for r in rows} == {t.format(topic=topic) for topic in ps.TOPICS
                                               for t in ps.TOPIC_INSTRUCTIONS}
    assert all(r["category"] == "code" for r in rows)


def test_loaders_read_the_sets_and_training_refuses_the_held_out_one(built, tmp_path):
    out, meta = built
    held = out / "code_heldout.jsonl"
    prompts = load_bench_prompts(held, math_suffix="auto")
    assert len(prompts) == meta["rows"]["code_heldout.jsonl"] and {p.category for p in prompts} == {"code"}
    assert len(read_prompts(out / "code_stdlib_train.jsonl")) == meta["rows"]["code_stdlib_train.jsonl"]
    assert len(read_prompts(out / "code_topics.jsonl", limit=7)) == 7
    with pytest.raises(EvaluationDataError, match="code_heldout.jsonl: a held-out set"):
        read_prompts(held)
    renamed = tmp_path / "more_code.jsonl"
    renamed.write_text(held.read_text())
    with pytest.raises(EvaluationDataError, match=r"more_code.jsonl:1: .* held-out code set"):
        read_prompts(renamed)


def test_passages_are_whole_paragraphs_in_order_within_the_bounds():
    a, b, c, d, e, f, g, h = ("x" * n for n in (300, 500, 900, 200, 1000, 100, 40, 900))
    lines = [f"row {i} " + "y" * 300 for i in range(8)]  # one paragraph of 2.5K chars: cut at its lines
    dump = "z" * 2500  # a single line longer than hi: left out
    big = "w" * 1500
    text = "\n\n".join([a, b, c, "\n".join(lines), dump, d, e, h, big, f, g])
    got = ps.split_passages(text, lo=1000, hi=2000)
    join = "\n\n".join
    # h (900) would overflow with big (1500): the short one is dropped and big starts a passage; f
    # and g, too short alone at the end, join it.
    assert got == [join([a, b, c]), join(lines[:4]), join(lines[4:]), join([d, e]), join([big, f, g])]
    assert all(1000 <= len(p) <= 2000 for p in got)
    assert ps.split_passages("short " * 10, lo=1000, hi=2000) == []


def test_context_tasks(built):
    out, meta = built
    rows = rows_of(out / "context_tasks.jsonl")
    assert len(rows) == meta["rows"]["context_tasks.jsonl"] > 300
    kinds = set(ps.CONTEXT_INSTRUCTIONS)
    by_passage: dict[str, set[str]] = {}
    for row in rows:
        passage, kind = row["source"].rsplit(":", 1)
        assert row["category"] == kind and kind in kinds
        by_passage.setdefault(passage, set()).add(kind)
        assert ps.CONTEXT_MIN_CHARS < len(row["instruction"]) < ps.CONTEXT_MAX_CHARS + 300
    assert all(found == kinds for found in by_passage.values())
    assert any(p.startswith("topic:") for p in by_passage) and any(p.startswith("doc:") for p in by_passage)
    # The held-out modules' prose stays out, as their functions do.
    held = {p.split(":")[1].split("#")[0].split(".")[0] for p in by_passage if p.startswith("doc:")}
    assert not held & {m.split(".")[0] for m in ps.HELDOUT_MODULES}
    assert len(read_prompts(out / "context_tasks.jsonl")) == len(rows)


def test_seed_tasks_are_decodable_and_cover_every_topic(built):
    out, meta = built
    rows = rows_of(out / "seed_tasks.jsonl")
    per_topic = len(ps.CHAT_SEED_INSTRUCTIONS) + 1
    assert len(rows) == meta["rows"]["seed_tasks.jsonl"] == len(ps.CHAT_TOPICS) * per_topic * ps.SEED_COPIES
    assert len(set(ps.CHAT_TOPICS)) == len(ps.CHAT_TOPICS)
    assert all(r["prompt"] == r["instruction"] for r in rows)
    assert {r["category"] for r in rows} == {"seed-chat", "seed-german"}
    assert len({r["source"] for r in rows}) == len(rows)
    from dflash_jax.decode import read_prompts as read_decode_rows
    assert [r.text for r in read_decode_rows(out / "seed_tasks.jsonl")] == [r["prompt"] for r in rows]


def test_derived_tasks_keep_usable_answers_as_prompts():
    def answer(kind, text, n):
        return {"category": kind, "source": f"{kind}:{n}", "text": text}

    answers = [
        answer("seed-chat", '"How do tides follow the moon?"', 0),  # quoted
        answer("seed-chat", "Question: Why do cats purr at night?\n\nSome rambling after it.", 1),  # label, tail
        answer("seed-chat", "How do tides follow the moon?", 2),  # the same prompt again
        answer("seed-chat", "Hi.", 3),  # too short
        answer("seed-chat", "x" * (ps.MAX_DERIVED_CHARS + 1), 4),  # too long
        answer("seed-german", "Der Hund schläft im Garten. Die Sonne scheint.", 5),
        answer("code", "def f(): pass  # not a seed answer", 6),
    ]
    got = {r["instruction"]: r for r in ps.derived_tasks(answers)}
    assert set(got) == {"How do tides follow the moon?", "Why do cats purr at night?",
                        "Translate German to English: Der Hund schläft im Garten. Die Sonne scheint."}
    assert got["Why do cats purr at night?"]["category"] == "chat"
    assert got["Translate German to English: Der Hund schläft im Garten. Die Sonne scheint."]["category"] == \
        "translation"


def test_make_prompts_answers_writes_the_derived_set(built, tmp_path, capsys):
    out, _ = built
    answers = tmp_path / "answers.jsonl"
    seeds = rows_of(out / "seed_tasks.jsonl")[:3]
    answers.write_text("".join(json.dumps({**r, "text": f"What is the answer number {n}?"}) + "\n"
                               for n, r in enumerate(seeds)))
    target = tmp_path / "prompts"
    assert main(["make-prompts", "--answers", str(answers), "--out", str(target)]) == 0
    derived = rows_of(target / ps.DERIVED_FILE)
    assert len(derived) == 3 and json.loads((target / ps.META_FILE).read_text())["rows"] == {ps.DERIVED_FILE: 3}
    assert len(read_prompts(target / ps.DERIVED_FILE)) == 3  # a training set make-data takes
    capsys.readouterr()
    assert main(["make-prompts", "--answers", str(tmp_path / "missing.jsonl"), "--out", str(target)]) == 2
    assert "--answers" in capsys.readouterr().err
    useless = tmp_path / "useless.jsonl"
    useless.write_text(json.dumps({**seeds[0], "text": "ok"}) + "\n")
    assert main(["make-prompts", "--answers", str(useless), "--out", str(target)]) == 2
    assert "no usable answers" in capsys.readouterr().err


def test_file_and_limit(tmp_path):
    assert file_and_limit("a/b.jsonl:128") == (Path("a/b.jsonl"), 128)
    assert file_and_limit("a/b.jsonl") == (Path("a/b.jsonl"), None)
    odd = tmp_path / "x.jsonl:3"
    odd.write_text("")
    assert file_and_limit(odd) == (odd, None)  # an existing file's own name wins
    with pytest.raises(ValueError, match="b.jsonl:0: the row limit"):
        file_and_limit("b.jsonl:0")


def test_make_prompts_refuses_an_unknown_set_before_writing(tmp_path, capsys):
    assert main(["make-prompts", "code-golf", "--out", str(tmp_path / "p")]) == 2
    assert "unknown prompt set(s) ['code-golf']" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def card_table(heading: str) -> list[list[str]]:
    """The cells of the Markdown table under `## heading` of the card (header and rule left out)."""
    section = CARD.read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in rows]


def card_counts() -> dict[str, int]:
    """The card's source table: {file: rows}, from rows `| source | file | rows | ...`."""
    return {cells[1].strip("`"): int(cells[2]) for cells in card_table("Sources")}


def test_data_card_mix_adds_up():
    counts = card_counts()
    mix = {cells[0].split(":")[0]: cells[1:] for cells in card_table("The mix")}
    assert mix["code"][0] == f"{counts['code_stdlib_train.jsonl']} + {counts['code_topics.jsonl']}"
    assert mix["chat"][0] == str(counts["alpaca_eval/instructions.jsonl"])
    assert mix["context"][0] == str(counts["context_tasks.jsonl"])
    assert mix["written by the target"][0] == str(counts["derived_tasks.jsonl"])
    gsm8k = int(mix["math"][0])
    assert gsm8k <= counts["gsm8k/train.jsonl"] and f"train.jsonl:{gsm8k}" in CARD.read_text()
    for prompts, responses in mix.values():
        assert int(responses) == 4 * sum(int(n) for n in prompts.split("+"))
    runbook = (ROOT / "dflash_jax" / "bench" / "gpu_runbook.sh").read_text()
    assert f"MIX_GSM8K:-{gsm8k}" in runbook and "SAMPLES:-4" in runbook


def test_data_card_counts_are_the_generators(built):
    out, meta = built
    counts = card_counts()
    card_python = re.search(r"Python (\d+\.\d+)", CARD.read_text()).group(1)
    assert counts["code_topics.jsonl"] == meta["rows"]["code_topics.jsonl"]
    if card_python != meta["python"]:
        pytest.skip(f"the card counts the stdlib of Python {card_python}; this is {meta['python']}, whose "
                    f"stdlib has other functions")
    assert counts["seed_tasks.jsonl"] == meta["rows"]["seed_tasks.jsonl"] == counts["derived_tasks.jsonl"]
    for name in ("code_stdlib_train.jsonl", "code_heldout.jsonl", "context_tasks.jsonl"):
        assert counts[name] == meta["rows"][name], name
    if SHARED.is_dir():
        for name, path in (("gsm8k/train.jsonl", SHARED / "gsm8k" / "train.jsonl"),
                           ("alpaca_eval/instructions.jsonl", SHARED / "alpaca_eval" / "instructions.jsonl"),
                           ("gsm8k/test.jsonl", SHARED / "gsm8k" / "test.jsonl"),
                           ("spec_bench/question.jsonl", SHARED / "spec_bench" / "question.jsonl")):
            assert counts[name] == len(path.read_text().splitlines()), name


def test_eval_mix_phase_builds_the_code_set_and_names_a_bad_drafter_choice(tmp_path):
    """The runbook's eval-mix makes the held-out code set itself (a fresh GPU machine has none),
    then refuses an EVAL_MIX entry it does not know, by name, before any benchmark."""
    import os
    import subprocess

    env = {**os.environ, "DRY": "1", "EVAL_MIX": "latest",
           "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", str(ROOT / "dflash_jax" / "bench" / "gpu_runbook.sh"), "eval-mix", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "eval-mix: unknown EVAL_MIX entry latest (mix, shipped)" in done.stderr
    meta = json.loads((tmp_path / "prompt_sets.json").read_text())
    assert (tmp_path / "run" / "prompts" / "code_heldout.jsonl").is_file()
    assert meta["rows"]["code_heldout.jsonl"] == len(rows_of(tmp_path / "run" / "prompts" / "code_heldout.jsonl"))
