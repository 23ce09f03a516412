"""`eb.save` / `eb.load` of a 1000-member stacked MLP ensemble: safetensors files
against eqx_batch's former container format (`_container_format.py`), side by side.

Both write atomically (temporary file, fsync, rename, fsync of the folder) and check a
CRC-32 of everything they read; the new format also checks sizes before reading,
parses the header with the safetensors package and validates every leaf record.
Target: no slower than the former format. Usage: `python benchmarks/bench_serialise.py`
(or through `benchmarks/run.py serialise`).
"""

import pathlib
import tempfile

import _container_format
import equinox as eqx
import jax
import jax.random as jr
from _report import interleaved, report

import eqx_batch as eb


MEMBERS = 1000


def main() -> None:
    keys = jr.split(jr.key(0), MEMBERS)
    ensemble = eqx.filter_vmap(lambda k: eqx.nn.MLP(2, 2, 32, 2, key=k))(keys)
    ensemble = jax.block_until_ready(ensemble)
    with tempfile.TemporaryDirectory() as folder:
        ours_path = pathlib.Path(folder) / "ensemble.safetensors"
        base_path = pathlib.Path(folder) / "ensemble.eqx"
        ours, base = interleaved(
            lambda: eb.save(ours_path, ensemble),
            lambda: _container_format.write(base_path, ensemble),
        )
        size = ours_path.stat().st_size
        report(
            f"eb.save, {MEMBERS}-member MLP ensemble vs former format",
            ours / base,
            "<= 1.0",
            ours <= base,
            f"{ours * 1e3:.1f} ms vs {base * 1e3:.1f} ms, {size / 1e6:.1f} MB",
        )
        ours, base = interleaved(
            lambda: jax.block_until_ready(eb.load(ours_path, like=ensemble)),
            lambda: jax.block_until_ready(_container_format.read(base_path, ensemble)),
        )
        report(
            f"eb.load, {MEMBERS}-member MLP ensemble vs former format",
            ours / base,
            "<= 1.0",
            ours <= base,
            f"{ours * 1e3:.1f} ms vs {base * 1e3:.1f} ms",
        )


if __name__ == "__main__":
    main()
