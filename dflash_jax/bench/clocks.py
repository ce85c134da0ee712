"""The GPU's SM clock, power and throttle reasons while a block of code runs, and calls timed
rested or back to back.

A DDTree(256) round on an H200 runs at the board's 700 W limit: the SM clock sits at 1560-1650
MHz of 1980 with the "SW power cap" throttle reason set in nearly every sample (BENCHMARKS.md,
"The power limit"), and the same code's rounds differ by 4-5% between machines. A timing that
carries the clock it ran at can be compared across machines.

    with ClockSampler() as clocks:
        ...  # the timed calls
    row["clocks"] = clocks.summary

`nvidia-smi` samples every `period_ms` in a subprocess; without it (a CPU, a driver that refuses
the query) the summary says why instead of raising, as a benchmark aid must not stop a run.
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
import time
from typing import Any, Callable, Sequence

import jax

# Bits of nvidia-smi's clocks_throttle_reasons.active (NVML's clocksThrottleReasons).
SW_POWER_CAP = 0x4
THERMAL = 0x8 | 0x20 | 0x40 | 0x80  # HW slowdown, SW thermal, HW thermal, HW power brake


def _percentiles(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    n = len(ordered)
    return {"p10": ordered[n // 10], "median": statistics.median(ordered), "p90": ordered[(9 * n) // 10]}


def parse(lines: Sequence[str]) -> list[tuple[float, float, int]]:
    """nvidia-smi rows "clock MHz, power W, throttle bitmask" (csv, noheader, nounits) ->
    (clock, power, mask) per sample, in order; rows that do not parse (a trailing partial
    line, "N/A") are skipped."""
    samples = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            samples.append((float(parts[0]), float(parts[1]), int(parts[2], 16)))
        except ValueError:
            continue
    return samples


def summarize_samples(samples: Sequence[tuple[float, float, int]]) -> dict[str, Any]:
    """`parse`'s samples -> the SM clock's and power's p10 / median / p90 and the fraction of
    samples power-capped or thermally throttled."""
    clocks, power, reasons = [c for c, _, _ in samples], [p for _, p, _ in samples], [m for _, _, m in samples]
    if not clocks:
        return {"error": "no samples"}
    return {"samples": len(clocks), "sm_clock_mhz": _percentiles(clocks), "power_w": _percentiles(power),
            "power_capped": round(sum(bool(m & SW_POWER_CAP) for m in reasons) / len(reasons), 3),
            "thermal": round(sum(bool(m & THERMAL) for m in reasons) / len(reasons), 3)}


def _power_field(smi: str) -> str:
    """power.draw.instant where the driver has it (power.draw is a one-second average)."""
    probe = subprocess.run([smi, "--query-gpu=power.draw.instant", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=10)
    return "power.draw.instant" if probe.returncode == 0 and probe.stdout.strip()[:1].isdigit() else "power.draw"


class ClockSampler:
    """Samples GPU `gpu` every `period_ms` from entering the block to leaving it; then
    `summary` holds `summarize_samples`' result (or {"error": ...})."""

    def __init__(self, period_ms: int = 50, gpu: int = 0):
        self.period_ms, self.gpu = period_ms, gpu
        self.summary: dict[str, Any] = {"error": "not run"}
        self.samples: list[tuple[float, float, int]] = []  # one per period_ms, in order
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> "ClockSampler":
        smi = shutil.which("nvidia-smi")
        if smi is None:
            self.summary = {"error": "no nvidia-smi"}
            return self
        try:
            query = f"clocks.sm,{_power_field(smi)},clocks_throttle_reasons.active"
            self._proc = subprocess.Popen(
                [smi, f"--id={self.gpu}", f"--query-gpu={query}", "--format=csv,noheader,nounits",
                 f"--loop-ms={self.period_ms}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self.summary = {"query": query}
        except (OSError, subprocess.SubprocessError) as err:
            self.summary = {"error": repr(err)[:200]}
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            out, err = self._proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, err = self._proc.communicate()
        self.samples = parse(out.splitlines())
        summary = summarize_samples(self.samples)
        if "error" in summary and err.strip():
            summary["stderr"] = err.strip()[:200]
        self.summary = {**self.summary, **summary}


def timed_calls(call: Callable[[], Any], *, calls: int = 0, rest_s: float = 0.0, seconds: float = 0.0
                ) -> list[float]:
    """Wall ms of each `call()` (blocked until ready): `calls` of them, each after `rest_s` of
    sleep so that it starts below the power limit, or, with `seconds`, back to back until that
    much time has passed, as sustained decoding runs."""
    times: list[float] = []
    end = time.perf_counter() + seconds
    while (len(times) < calls) if not seconds else (time.perf_counter() < end):
        if rest_s:
            time.sleep(rest_s)
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append((time.perf_counter() - t0) * 1e3)
    return times
