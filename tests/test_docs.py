"""The documents against the repository: README's results come from BENCHMARKS.md, BENCHMARKS.md's
result files exist (and only those are kept), and the commands the documents give name tools,
flags and runbook phases that exist."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "dflash_jax" / "bench"
RESULTS = BENCH / "results"
DOCS = ("README.md", "BENCHMARKS.md", "BUILD.md")
# A number as a reader sees it: digits with an optional decimal part, not part of a longer one.
NUMBER = re.compile(r"(?<![\d.])\d+(?:\.\d+)?(?![\d]|\.\d)")


def read(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def readme_results_rows() -> list[str]:
    """The table rows of README's "## Results" section (header and rule left out)."""
    section = read("README.md").split("\n## Results", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return rows[2:]


def test_documents_keep_their_length_limits():
    limits = {"README.md": 120, "BENCHMARKS.md": 400, "BUILD.md": 150}
    for name, limit in limits.items():
        assert len(read(name).splitlines()) <= limit, f"{name} is longer than {limit} lines"


def test_every_readme_result_number_is_in_benchmarks():
    rows = readme_results_rows()
    assert 0 < len(rows) <= 12, f"README's results table has {len(rows)} rows (1 to 12 allowed)"
    benchmarks = set(NUMBER.findall(read("BENCHMARKS.md")))
    for row in rows:
        missing = [n for n in NUMBER.findall(row) if n not in benchmarks]
        assert not missing, f"README row {row!r}: {missing} not found in BENCHMARKS.md"


def test_benchmarks_cites_every_result_file_and_only_existing_ones():
    cited = set(re.findall(r"results/([A-Za-z0-9_.\-]+)", read("BENCHMARKS.md")))
    assert cited, "BENCHMARKS.md names no result file"
    present = {p.name for p in RESULTS.iterdir() if p.is_file()}
    assert not cited - present, f"BENCHMARKS.md names missing result files: {sorted(cited - present)}"
    assert not present - cited, f"result files BENCHMARKS.md does not cite: {sorted(present - cited)}"


def bench_commands(text: str) -> list[tuple[str, list[str]]]:
    """(module, its --flags) for every `python -m dflash_jax.bench.MODULE ...` command in text."""
    found = []
    for match in re.finditer(r"python -m dflash_jax\.bench\.(\w+)([^`\n]*)", text):
        found.append((match.group(1), re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", match.group(2))))
    return found


@pytest.mark.parametrize("name", DOCS)
def test_bench_commands_name_existing_tools_and_flags(name):
    sources = {p.stem: p.read_text(encoding="utf-8") for p in BENCH.glob("*.py")}
    every = "\n".join(sources.values())  # a tool may take its flags from a shared helper
    for module, flags in bench_commands(read(name)):
        assert module in sources, f"{name}: no tool dflash_jax/bench/{module}.py"
        for flag in flags:
            assert f'"{flag}"' in every, f"{name}: `{module}` has no flag {flag}"


def test_runbook_phases_named_in_the_documents_exist():
    runbook = (BENCH / "gpu_runbook.sh").read_text(encoding="utf-8")
    case = runbook.split("\ncase $phase in\n", 1)[1]
    labels = set(re.findall(r"^([a-z0-9|\s-]+)\)\s*$", case, flags=re.M))
    phases = {p.strip() for label in labels for p in label.split("|")}
    assert {"ar", "decode", "rounds", "kernel", "tp"} <= phases
    for name in ("BENCHMARKS.md", "BUILD.md"):
        lists = re.findall(r"phases? ((?:`[a-z0-9-]+`(?:,\s*|\s+and\s+|\s+or\s+)?)+)", read(name))
        named = {p for found in lists for p in re.findall(r"`([a-z0-9-]+)`", found)}
        assert named, f"{name} names no runbook phase"
        assert not named - phases, f"{name} names runbook phases that do not exist: {sorted(named - phases)}"


def test_bench_holds_at_most_a_quarter_of_the_python_lines():
    def lines(paths) -> int:
        return sum(len(p.read_text(encoding="utf-8").splitlines()) for p in paths)

    every = [p for d in ("dflash_jax", "pallas_kernels", "convert", "tests") for p in (ROOT / d).rglob("*.py")]
    bench = [p for p in every if BENCH in p.parents]
    assert lines(bench) * 4 <= lines(every), f"bench/ holds {lines(bench)} of {lines(every)} Python lines"


def test_documents_and_result_names_speak_only_of_the_project():
    """No word of how the work was scheduled: work periods, device calls."""
    # "[s]": a grep of the tree for these words does not find this line.
    words = re.compile(r"[s]ession|s\d+_call|call \d+", re.I)
    texts = {name: read(name) for name in DOCS}
    texts["gpu_runbook.sh"] = (BENCH / "gpu_runbook.sh").read_text(encoding="utf-8")
    texts["results/ names"] = "\n".join(p.name for p in RESULTS.iterdir())
    for name, text in texts.items():
        hits = words.findall(text)
        assert not hits, f"{name}: {hits}"
