"""The SASS lines of a kernel where its warps stalled most, from `ncu --page source --csv` output.

    ncu --import REP --page source --csv --print-source sass --kernel-name NAME > sass.csv
    python -m dflash_jax.bench.ncu_sass sass.csv --top 60

Prints, for the `--top` instructions with the most stall samples, the instruction, its samples
by stall reason, and the lines around it (so that a barrier wait can be told from a product).
"""
from __future__ import annotations

import argparse
import csv
import io


def read_rows(path: str) -> tuple[list[str], list[dict]]:
    """The CSV's header and rows, skipping anything ncu printed before the header."""
    text = open(path, encoding="utf-8", errors="replace").read()
    start = text.find('"Address"')
    if start < 0:
        start = text.find("Address")
    rows = list(csv.DictReader(io.StringIO(text[max(start, 0):])))
    return (list(rows[0].keys()) if rows else []), rows


def number(value: str) -> float:
    try:
        return float(str(value).replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--context", type=int, default=2)
    args = ap.parse_args()
    header, rows = read_rows(args.csv)
    total_col = next((h for h in header if h.startswith("Warp Stall Sampling (All")), None)
    stall_cols = [h for h in header if h.startswith("stall_") and "Not Issued" not in h] or \
        [h for h in header if "stall" in h.lower() and "not issued" not in h.lower() and h != total_col]
    source_col = next((h for h in header if h in ("Source", "SASS")), header[1] if len(header) > 1 else "")
    print("columns:", header)
    if not total_col:
        print("no stall-sampling column")
        return
    total = sum(number(r[total_col]) for r in rows)
    print(f"{len(rows)} instructions, {total:.0f} stall samples")
    order = sorted(range(len(rows)), key=lambda i: -number(rows[i][total_col]))[:args.top]
    for i in order:
        r = rows[i]
        reasons = {c: number(r[c]) for c in stall_cols if number(r[c])}
        ranked = sorted(reasons.items(), key=lambda kv: -kv[1])[:4]
        top = ", ".join(f"{c.replace('stall_', '')} {v:.0f}" for c, v in ranked)
        print(f"\n#{i} {number(r[total_col]):.0f} samples ({100 * number(r[total_col]) / max(total, 1):.1f}%): {top}")
        for j in range(max(0, i - args.context), min(len(rows), i + args.context + 1)):
            mark = ">>" if j == i else "  "
            print(f"  {mark} {j:5d} {rows[j].get(source_col, '')[:110]}")


if __name__ == "__main__":
    main()
