"""The checkpoint of `eb.run_chains`: read back once, then written in the background.

A checkpoint at `path` is a few safetensors files in one folder (their names:
`_checkpoint_files.py`):

- `path`: the run file, written once by process 0 when the run first writes: the
    run's identity. A call of another run is refused, saying what differs.
- the state files of each checkpointed step, and the draw files, each written by the
    process whose devices hold those chains, in its own writer thread, with no
    gathering between processes: in one process, one state file and one draw file
    per segment. Every file repeats the run's identity, checked when it is read
    (`_checkpoint_metadata.py`).
- `path.chains-A-B` and its files: with `chunk_size`, the checkpoint of chains `A`
    to `B`, a run of its own (the chunks share the lock of `path`).
- `path.lock`: locked (`flock`) by process 0 while the run writes (`_lock.py`).

Every file is written atomically, draw files before the state files that list them,
and a step counts once its state files cover every chain: a kill at any moment loses
at most the segment in flight. A run resumes, or reads back, on any layout of
processes and devices, each process reading the rows its devices now hold
(`_checkpoint_rows.py`).

The files hold raw data: typed PRNG keys are written as their key data, and made keys
again when read back.

Reading (`_checkpoint_reader.py`) and writing (`_checkpoint_writer.py`) are apart, as
Equinox keeps `tree_serialise_leaves` and `tree_deserialise_leaves`: `Checkpoint`
hands the writer what the reader found, and neither calls the other.
"""

import pathlib
from collections.abc import Callable
from typing import Any

from .._common import Draws
from .._jobs._identity import RunIdentity
from ._checkpoint_metadata import RunMetadata
from ._checkpoint_reader import CheckpointReader, Expected, Restored
from ._checkpoint_writer import CheckpointWriter, Snapshot
from ._disk_trace import ListedFile
from ._lock import WriteAccess
from ._recording import Recording, SegmentFiles


class Checkpoint:
    """One chunk's checkpoint files: read back, then written in the background.

    Used as a context manager. `restore` reads what is there without writing; a run
    with steps left then calls `start_writing`, which takes the right to write
    (`access`), writes the run file and starts this process's writer thread. Leaving
    it waits for the last write.
    """

    def __init__(
        self,
        path: pathlib.Path,
        identity: RunIdentity,
        num_chains: int,
        access: WriteAccess,
    ):
        self.metadata = RunMetadata(path, identity)
        self.num_chains = num_chains
        self.access = access
        self.reader = CheckpointReader(self.metadata, num_chains)
        # Made by `restore`, to go on from what it found.
        self.writer: CheckpointWriter | None = None

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if self.writer is not None:
            self.writer.close(failed=kind is not None)

    def restore(self, expected: Callable[[], Expected]) -> Restored | None:
        """The run as last checkpointed, checked against what the run expects
        (`expected()`); None if there is no checkpoint, or no step whose state files
        cover every chain.

        Only the files' metadata are read here: the arrays are read when placed
        (`RowReader`), each process reading the rows its devices hold. Nothing is
        written.

        Raises as `CheckpointReader.read` does.
        """
        expects = expected()
        found = self.reader.read(expects)
        self.writer = CheckpointWriter(
            self.metadata,
            self.num_chains,
            self.access,
            found.on_disk,
            expects.problems,
        )
        return found.restored

    def start_writing(self) -> None:
        """Takes the right to write, writes the run file (process 0) and starts this
        process's writer (`CheckpointWriter.start`). Call `restore` first."""
        assert self.writer is not None
        self.writer.start()

    def segment_files(
        self, recording: Recording, draws: Draws, start: int, stop: int
    ) -> SegmentFiles | None:
        """Where the draws of the segment from `start` to `stop` go, as `recording`
        puts them; None if it makes none."""
        return recording.segment_files(draws, start, stop)

    def write(self, snapshot: Snapshot) -> None:
        """Writes this process's rows of `snapshot` in the background
        (`CheckpointWriter.write`)."""
        assert self.writer is not None
        self.writer.write(snapshot)

    def draw_listing(self) -> list[ListedFile]:
        """The draw files of the newest complete step (`CheckpointReader.draw_listing`):
        call it after the writes."""
        return self.reader.draw_listing()
