"""Run every `benchmarks/bench_*.py` in a fresh process and print one table of ratios.

Each script measures eqx_batch against the baseline it must beat, side by side in one
run, and prints `RESULT {json}` lines through `_report.report`. Usage:
`python benchmarks/run.py [name-filter ...]`. Exits non-zero if a script fails to run,
not if a target is missed: these machines are shared and noisy, so the table is for
reading, not for gating.
"""

import json
import pathlib
import subprocess
import sys
import time


HERE = pathlib.Path(__file__).parent


def main(filters: list[str]) -> int:
    scripts = sorted(HERE.glob("bench_*.py"))
    if filters:
        scripts = [s for s in scripts if any(f in s.stem for f in filters)]
    rows: list[dict] = []
    failed: list[str] = []
    for script in scripts:
        start = time.perf_counter()
        print(f"running {script.name} ...", file=sys.stderr, flush=True)
        proc = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, cwd=HERE
        )
        elapsed = time.perf_counter() - start
        if proc.returncode != 0:
            failed.append(script.name)
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            continue
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                row = json.loads(line[len("RESULT ") :])
                row["script"] = script.stem
                rows.append(row)
        print(f"  done in {elapsed:.1f}s", file=sys.stderr, flush=True)

    width = max([len(r["name"]) for r in rows] + [9])
    print(f"\n{'benchmark':<{width}}  {'ratio':>8}  {'target':>9}  met  detail")
    print("-" * (width + 40))
    for r in rows:
        met = "yes" if r["ok"] else "NO"
        print(
            f"{r['name']:<{width}}  {r['ratio']:>8.3f}  {r['target']:>9}  {met:<3}  "
            f"{r['detail']}"
        )
    if failed:
        print(f"\nfailed to run: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
