"""Plots DDTree round latency (and its stages) against the node budget from spec_round's JSON.

python -m dflash_jax.bench.plot_budget spec.json ddtree_latency_vs_budget.png
"""
from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot(json_path: str, png_path: str) -> None:
    record = json.load(open(json_path))
    rows = sorted((r for r in record["rows"] if r["method"] == "ddtree"), key=lambda r: r["budget"])
    budgets = [r["budget"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    def value(r: dict, key: str) -> float | None:
        """The round's wall time, or its device time / a stage's from the round's profile."""
        if key == "round_ms":
            return r["round_ms"]
        prof = r.get("profile") or {}
        if key == "device_ms":
            return prof.get("device_ms")
        return (prof.get("by_scope") or {}).get(key)

    per_call = rows[0].get("rounds_per_call", 1)
    wall = "fused round (wall)" if per_call > 1 else "one round per call (wall, host dispatch included)"
    for key, label in [("round_ms", wall), ("device_ms", "device time (profile)"),
                       ("draft", "drafter pass"), ("tree", "tree build"),
                       ("verify", "verify (target + tree attention)"), ("accept", "accept"),
                       ("commit", "commit")]:
        vals = [value(r, key) for r in rows]
        if all(v is not None for v in vals):
            ax.plot(budgets, vals, marker="o", label=label)
    for r in record["rows"]:
        if r["method"] == "dflash" and r["ctx"] == rows[0]["ctx"]:
            ax.axhline(r["round_ms"], color="gray", ls="--", lw=1, label="DFlash round (block 16)")
    env = record["env"]
    ax.set_xscale("log", base=2)
    ax.set_xlabel("DDTree budget (drafted nodes)")
    ax.set_ylabel("ms")
    ax.set_title(f"DDTree round, Qwen3-8B shape, ctx {rows[0]['ctx']}\n{env['device']}, jax {env['jax']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)


if __name__ == "__main__":
    plot(sys.argv[1], sys.argv[2])
