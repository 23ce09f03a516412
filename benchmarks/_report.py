"""The one way a benchmark reports: `report(...)` prints a line `run.py` collects."""

import json
import resource
import subprocess
import sys
import time
from collections.abc import Callable


def report(name: str, ratio: float, target: str, ok: bool, detail: str = "") -> None:
    """Print one result: `ratio` is ours / baseline measured side by side in one run.

    `target` says what the ratio must be (`"<= 0.65"`, `">= 8"`, `"report"`).
    """
    line = {"name": name, "ratio": ratio, "target": target, "ok": ok, "detail": detail}
    print("RESULT " + json.dumps(line), flush=True)


def best_of(fn: Callable[[], object], repeat: int = 5, number: int = 1) -> float:
    """The fastest of `repeat` timings of `number` calls to `fn`, per call (seconds)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - start) / number)
    return best


def interleaved(
    ours: Callable[[], object],
    baseline: Callable[[], object],
    repeat: int = 7,
    number: int = 1,
) -> tuple[float, float]:
    """Best per-call times of `ours` and `baseline`, alternated so noise hits both."""
    best_ours = best_base = float("inf")
    for _ in range(repeat):
        best_base = min(best_base, best_of(baseline, 1, number))
        best_ours = min(best_ours, best_of(ours, 1, number))
    return best_ours, best_base


def print_time_and_peak(run: Callable[[], object], repeat: int = 2) -> None:
    """In a child process: `run` once to compile, then print as JSON its best time of
    `repeat` and the process's peak resident memory."""
    run()
    seconds = best_of(run, repeat)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"seconds": seconds, "peak_mib": peak_kib / 1024}))


def measure_in_child(script: str, argument: object) -> dict:
    """Runs `python script child <argument as JSON>` in a fresh process, so that peak
    memory is its own, and returns the JSON its last line printed."""
    proc = subprocess.run(
        [sys.executable, script, "child", json.dumps(argument)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])
