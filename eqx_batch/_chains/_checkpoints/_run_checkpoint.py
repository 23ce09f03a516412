"""A run's checkpoint, decided once from `checkpoint=`: none (`NoCheckpoint`), or the
files at a path (`CheckpointAt`). `run_chains` makes it and hands it down: the checks
of the arguments, the plan, the right to write, each chunk's files, and the trace read
from disk call it, and nothing below the driver asks whether there is one. A chunk of
a run without one holds `NoFiles`, which keeps nothing.
"""

import contextlib
import os
import pathlib
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from ..._errors import BatchError, describe
from .._common import Draws
from .._jobs._identity import RunIdentity
from ._checkpoint import Checkpoint
from ._checkpoint_files import chunk_path, longest_file_name, warn_of_other_chunkings
from ._checkpoint_reader import Expected, Restored
from ._checkpoint_writer import Snapshot
from ._disk_trace import disk_trace, ListedFile
from ._lock import check_folder, refuse_if_in_use, WriteAccess
from ._recording import Recording, SegmentFiles


_T = TypeVar("_T")


class FileNames(NamedTuple):
    """What the names of a run's files depend on: its chunks (None if unchunked),
    chains and recorded draws."""

    chunks: list[range] | None
    num_chains: int
    num_draws: int


class NoFiles:
    """A chunk's checkpoint when the run has none: nothing is read back or written."""

    def __enter__(self) -> "NoFiles":
        return self

    def __exit__(self, *error: Any) -> None:
        pass

    def restore(self, expected: Callable[[], Expected]) -> Restored | None:
        return None

    def start_writing(self) -> None:
        pass

    def segment_files(
        self, recording: Recording, draws: Draws, start: int, stop: int
    ) -> SegmentFiles | None:
        """Where the draws of the segment from `start` to `stop` go: nowhere."""
        return None

    def write(self, snapshot: Snapshot) -> None:
        pass

    def draw_listing(self) -> list[ListedFile]:
        raise AssertionError("only a run with a checkpoint keeps its draws on disk")


class NoCheckpoint:
    """A run without `checkpoint`."""

    # The bar moves between segments, at updates of its own (`RunContext.next_stop`):
    # no checkpoint's writes bound them.
    bounds_segments = False

    def require(self, refusal: str) -> None:
        """Refuses an argument that needs a checkpoint, with `refusal`."""
        raise BatchError(refusal)

    def traced(self, trace: Callable[[], _T]) -> _T | None:
        """The step, traced by `trace` for the run's identity: not needed."""
        return None

    def named(self) -> str:
        """The path, as the processes of a job compare it."""
        return "None"

    def opened(self, stack: contextlib.ExitStack, names: FileNames) -> "NoCheckpoint":
        """The checkpoint with the right to write it, taken when first needed: none
        to take."""
        return self

    def chunk_files(
        self, chunk: range | None, identity: Callable[[], RunIdentity], num_chains: int
    ) -> Checkpoint | NoFiles:
        """The checkpoint of `chunk`'s chains (None: every chain): none."""
        return NoFiles()

    def disk_trace(self, listing: list[ListedFile], like: Any) -> Any:
        raise AssertionError("`trace='disk'` is refused without a checkpoint")


class CheckpointAt:
    """A run checkpointed at `path`; with `access` once opened (`opened`)."""

    bounds_segments = True

    def __init__(self, path: pathlib.Path, access: WriteAccess | None = None):
        self.path, self.access = path, access

    def require(self, refusal: str) -> None:
        pass

    def traced(self, trace: Callable[[], _T]) -> _T | None:
        return trace()

    def named(self) -> str:
        # A relative path names another file in a process with another working folder.
        return os.path.abspath(self.path)

    def opened(self, stack: contextlib.ExitStack, names: FileNames) -> "CheckpointAt":
        """The checkpoint with the right to write it, once the checks that need no
        writing pass (of the files `names` says); the lock itself is taken when a
        chunk first writes (`CheckpointWriter.start`)."""
        check_folder(self.path)
        refuse_if_in_use(self.path)
        warn_of_other_chunkings(self.path, names.chunks)
        longest = longest_file_name(
            self.path,
            num_chains=names.num_chains,
            num_draws=names.num_draws,
            chunked=names.chunks is not None,
        )
        access = stack.enter_context(WriteAccess(self.path, longest))
        return CheckpointAt(self.path, access)

    def chunk_files(
        self, chunk: range | None, identity: Callable[[], RunIdentity], num_chains: int
    ) -> Checkpoint | NoFiles:
        """The checkpoint of `chunk`'s chains (None: every chain), named by them."""
        assert self.access is not None, "open it first"
        path = self.path
        if chunk is not None:
            path = chunk_path(self.path, chunk.start, chunk.stop)
        return Checkpoint(path, identity(), num_chains, self.access)

    def disk_trace(self, listing: list[ListedFile], like: Any) -> Any:
        """The trace of `like`'s shapes, read lazily from the draw files of
        `listing`."""
        return disk_trace(self.path, listing, like)


RunCheckpoint = NoCheckpoint | CheckpointAt


def run_checkpoint(checkpoint: Any) -> RunCheckpoint:
    """The checkpoint `checkpoint=` names.

    **Raises:**

    `BatchError` if `checkpoint` is neither a path nor None.
    """
    if checkpoint is None:
        return NoCheckpoint()
    if not isinstance(checkpoint, str | os.PathLike):
        raise BatchError(
            f"`checkpoint` is {describe(checkpoint)}: pass a path (a `str` or "
            "`pathlib.Path`), or None."
        )
    return CheckpointAt(pathlib.Path(checkpoint))
