"""The names of a checkpoint's files, and which of them make its newest complete step.

A checkpoint at `path` (name `N`) of the run with id `R` (`RunIdentity.run_id`) is:

- `N`: the run file, written once: the run's identity, and no arrays of its own.
- `N.R.state-S.rows-A-B`: the states, keys and NaN report of chains (rows) `A` to
    `B` after step `S`, with a listing of the draw files that hold their draws so far.
- `N.R.rows-A-B.draws-X-Y`: draws `X` to `Y` of chains `A` to `B`, written once.

Every process writes the rows of the chains its devices hold, so the rows of one step
may come in several files, and from several layouts of processes and devices (a run
resumed on another topology). There is no manifest: the checkpoint's state is the
newest step whose state files tile every row exactly once.

Nothing here reads or writes arrays; `_checkpoint_reader.py` and
`_checkpoint_writer.py` do.
"""

import contextlib
import os
import pathlib
import re
import warnings
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from ..._files._atomic import temporary_name


def chunk_path(path: pathlib.Path, first: int, stop: int) -> pathlib.Path:
    """The checkpoint of chains `first` to `stop` of a chunked run checkpointed at
    `path`: named by the chains it holds, so it is the same whatever the chunk size
    that made it."""
    return path.with_name(f"{path.name}.chains-{first}-{stop}")


def warn_of_other_chunkings(path: pathlib.Path, chunks: list[range] | None) -> None:
    """Warns of the checkpoints at `path` that a run in `chunks` (None: unchunked)
    does not read: those of chains split another way, by another `chunk_size`.

    Chunks that coincide are read back as they are; the chains of the others would be
    computed again, which can be days of work, so the user hears of it.
    """
    pattern = re.compile(rf"{re.escape(path.name)}\.chains-(\d+)-(\d+)")
    planned = {(chunk.start, chunk.stop) for chunk in chunks or []}
    other_sizes = set()
    for entry in os.scandir(path.parent):
        match = pattern.fullmatch(entry.name)
        if match and (int(match[1]), int(match[2])) not in planned:
            if int(match[1]) == 0:  # a chunking's first chunk has its full size
                other_sizes.add(int(match[2]))
    written = [f"with `chunk_size={size}`" for size in sorted(other_sizes)]
    if chunks is not None and path.exists():
        written.append("without `chunk_size`")
    if not written:
        return
    now = "without `chunk_size`" if chunks is None else f"`chunk_size={len(chunks[0])}`"
    warnings.warn(
        f"`checkpoint` ({path}) holds checkpoints written {' and '.join(written)}, "
        f"which this call ({now}) does not read: it computes those chains again. To "
        f"resume from them, call `run_chains` {' or '.join(written)}.",
        stacklevel=3,
    )


def longest_file_name(
    path: pathlib.Path, *, num_chains: int, num_draws: int, chunked: bool
) -> str:
    """The longest name of a file that a run checkpointed at `path` may write: the
    temporary file of a state or draw file (of a chunk, if `chunked`), with the
    largest counts it may hold."""
    name = chunk_path(path, num_chains, num_chains).name if chunked else path.name
    files = RunFiles(path.with_name(name), "f" * 16)
    rows = (num_chains, num_chains)
    names = [files.state_path(10**18, rows).name]  # steps fit in an int64
    if num_draws:
        names.append(files.draws_name(rows, (num_draws, num_draws)))
    return temporary_name(max(names, key=lambda n: len(n.encode())))


class DrawFile(NamedTuple):
    """One file of draws: draws `first` to `stop` of chains `rows[0]` to `rows[1]`."""

    name: str
    rows: tuple[int, int]
    draws: tuple[int, int]

    def holds(self) -> dict[str, str]:
        """The entries of its file's metadata that say which chains and draws it
        holds: its name says it too, but a file renamed keeps these."""
        return {
            "run_chains.rows": "{}-{}".format(*self.rows),
            "run_chains.draws": "{}-{}".format(*self.draws),
        }

    def to_json(self) -> list:
        return [self.name, *self.rows, *self.draws]

    @classmethod
    def from_json(cls, entry: Sequence) -> "DrawFile":
        name, first_row, stop_row, first, stop = entry
        return cls(name, (first_row, stop_row), (first, stop))


class StateFile(NamedTuple):
    """One state file: chains `rows[0]` to `rows[1]` after `step` steps."""

    path: pathlib.Path
    step: int
    rows: tuple[int, int]


class OnDisk(NamedTuple):
    """What of a run's checkpoint the reader found, for the writer to go on from: its
    run file, the newest step whose state files cover every chain (None: none), and
    the draw files they list."""

    run_file: bool = False
    steps_done: int | None = None
    draw_files: tuple[DrawFile, ...] = ()


def checkpoint_name_pattern(path: pathlib.Path) -> str:
    """A regular expression of the names of the checkpoint at `path` and of its
    chunks' checkpoints (`chunk_path`)."""
    return rf"{re.escape(path.name)}(?:\.chains-\d+-\d+)?"


def run_file_pattern() -> str:
    """A regular expression of what `RunFiles` adds to a checkpoint's name for its
    state and draw files, whatever the run id."""
    rows = r"rows-\d+-\d+"
    return rf"\.[0-9a-f]{{16}}\.(?:state-\d+\.{rows}|{rows}\.draws-\d+-\d+)"


class RunFiles:
    """The file names of the run with id `run_id` checkpointed at `path`."""

    def __init__(self, path: pathlib.Path, run_id: str):
        self.path = path
        self.run_id = run_id
        self._state_pattern = re.compile(
            rf"{re.escape(path.name)}\.{run_id}\.state-(\d+)\.rows-(\d+)-(\d+)"
        )

    def state_path(self, step: int, rows: tuple[int, int]) -> pathlib.Path:
        return self.path.with_name(
            f"{self.path.name}.{self.run_id}.state-{step}.rows-{rows[0]}-{rows[1]}"
        )

    def draws_name(self, rows: tuple[int, int], draws: tuple[int, int]) -> str:
        return (
            f"{self.path.name}.{self.run_id}.rows-{rows[0]}-{rows[1]}"
            f".draws-{draws[0]}-{draws[1]}"
        )

    def state_files(self) -> list[StateFile]:
        """Every state file of this run in the folder, whatever its step."""
        found = []
        for entry in os.scandir(self.path.parent):
            match = self._state_pattern.fullmatch(entry.name)
            if match:
                step, first, stop = (int(group) for group in match.groups())
                found.append(StateFile(pathlib.Path(entry.path), step, (first, stop)))
        return found

    def newest_complete(self, num_chains: int) -> list[StateFile] | None:
        """The state files of the newest step whose files tile chains 0 to
        `num_chains`; None if no step is complete."""
        by_step: dict[int, list[StateFile]] = {}
        for state_file in self.state_files():
            by_step.setdefault(state_file.step, []).append(state_file)
        for step in sorted(by_step, reverse=True):
            tiles = tiling(by_step[step], num_chains)
            if tiles is not None:
                return tiles
        return None

    def remove_states_before(self, num_chains: int) -> None:
        """Removes the state files of the steps before the newest complete one: never
        the newest complete set, nor files of later (incomplete) steps. Other
        processes may be removing the same files at the same time."""
        newest = self.newest_complete(num_chains)
        if newest is None:
            return
        for state_file in self.state_files():
            if state_file.step < newest[0].step:
                with contextlib.suppress(FileNotFoundError):
                    state_file.path.unlink()


def tiling(files: Iterable[StateFile], num_chains: int) -> list[StateFile] | None:
    """Files among `files` whose rows cover 0 to `num_chains` once each, in order;
    None if there are none. Files of several layouts may overlap: any tiling will
    do, as every chain's bits are the same whatever the layout that wrote them."""
    by_start: dict[int, list[StateFile]] = {}
    for state_file in files:
        by_start.setdefault(state_file.rows[0], []).append(state_file)
    # Depth first from row 0; `reached` stops a row being explored twice.
    reached: set[int] = set()

    def walk(row: int) -> list[StateFile] | None:
        if row == num_chains:
            return []
        if row in reached or row > num_chains:
            return None
        reached.add(row)
        for state_file in by_start.get(row, []):
            if state_file.rows[1] > row:
                rest = walk(state_file.rows[1])
                if rest is not None:
                    return [state_file, *rest]
        return None

    return walk(0)


def uncovered(
    entries: Iterable[DrawFile], rows: tuple[int, int], num_draws: int
) -> tuple[int, int] | None:
    """A chain and a draw of rows `rows` x draws `0..num_draws` that no entry holds;
    None if the entries cover them all."""
    entries = list(entries)
    # Coverage changes only at the entries' edges: one chain per stretch between
    # them stands for all of its stretch.
    row_edges = sorted({*rows, *(r for e in entries for r in e.rows)})
    for row in row_edges:
        if not rows[0] <= row < rows[1]:
            continue
        reached = 0
        for first, stop in sorted(
            e.draws for e in entries if e.rows[0] <= row < e.rows[1]
        ):
            if first > reached:
                break
            reached = max(reached, stop)
        if reached < num_draws:
            return row, reached
    return None
