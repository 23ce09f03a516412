"""What every file of a checkpoint says of itself in its metadata, and how a file that
says otherwise is refused.

Every file of a run's checkpoint repeats the run's identity (`RunIdentity`) and its id,
so that a file of another run, copied or renamed into the folder, is found when it is
read; a state file adds its progress record (its step, its rows and the draw files that
hold their draws), and a draw file the chains and draws it holds (`DrawFile.holds`).

The writer writes these entries (`_checkpoint_writer.py`); the reader checks them
(`_checkpoint_reader.py`), and so does the reader of the rows, when it opens a draw
file (`_checkpoint_rows.py`). Each is handed one `RunMetadata`, whose errors name the
checkpoint and say what to do.
"""

import json
import pathlib
from collections.abc import Mapping
from typing import Any

from ..._errors import BatchError, bullet_list
from ..._files._file_format import BadFileError, ForeignFileError, read_metadata
from .._jobs._identity import RunIdentity
from ._checkpoint_files import DrawFile


# The metadata entries of a run's files.
_IDENTITY = "run_chains.run"
_RUN_ID = "run_chains.run_id"
_PROGRESS = "run_chains.progress"


class RunMetadata:
    """The metadata of the files of the run `identity` checkpointed at `path`: the
    entries written, and their checks when read back."""

    def __init__(self, path: pathlib.Path, identity: RunIdentity):
        self.path = path
        self.identity = identity
        # Written in every file of the run.
        self.entries = {
            _IDENTITY: json.dumps(dict(identity.fields)),
            _RUN_ID: identity.run_id,
        }

    # -- writing -----------------------------------------------------------------------

    def of_state_file(self, progress: dict) -> dict[str, str]:
        """The metadata of a state file with the progress record `progress`."""
        return {**self.entries, _PROGRESS: json.dumps(progress)}

    def naming_the_run(self) -> dict[str, str]:
        """The entry that names the run, which a reader of the draws on disk checks
        (`ListedFile.metadata`)."""
        return {_RUN_ID: self.identity.run_id}

    # -- reading -----------------------------------------------------------------------

    @staticmethod
    def is_run_description(metadata: Mapping[str, str]) -> bool:
        """Whether `metadata` describes a run: those of an eqx_batch file that is not
        a `run_chains` checkpoint do not."""
        return _IDENTITY in metadata

    @staticmethod
    def has_progress(metadata: Mapping[str, str]) -> bool:
        """Whether `metadata` holds a progress record: a run file that does was
        written by an earlier eqx_batch, which kept every chain in it."""
        return _PROGRESS in metadata

    @staticmethod
    def progress(metadata: Mapping[str, str]) -> Any:
        """The progress record of a state file's `metadata`, as JSON. Raises
        `KeyError` or `ValueError` if there is none, or it does not parse."""
        return json.loads(metadata[_PROGRESS])

    def read(self, path: pathlib.Path, what: str) -> dict[str, str]:
        """The metadata of the file at `path`, the checkpoint's `what` ("state file"),
        unchecked; raises, naming it, if it is missing or unreadable."""
        try:
            return read_metadata(path)
        except FileNotFoundError:
            raise BatchError(
                f"the {what} {path} of `checkpoint` ({self.path}) is missing: delete "
                "its files to start afresh."
            ) from None
        except (BadFileError, OSError) as e:
            raise self.unreadable(what, e) from None

    def read_checked(self, path: pathlib.Path, what: str) -> dict[str, str]:
        """`read`, then `check_run`."""
        metadata = self.read(path, what)
        self.check_run(path, metadata)
        return metadata

    def check_run(self, path: pathlib.Path, metadata: Mapping[str, str]) -> None:
        """Raises unless the file at `path`, of the checkpoint, was written by this
        run, saying what differs if it was written by another."""
        try:
            saved = json.loads(metadata[_IDENTITY])
        except (KeyError, ValueError):
            saved = None
        if not isinstance(saved, dict):
            raise BatchError(
                f"{path} of `checkpoint` ({self.path}) is not a `run_chains` "
                "checkpoint file."
            )
        differences = self.identity.differences(saved)
        if differences or metadata.get(_RUN_ID) != self.identity.run_id:
            where = (
                f"`checkpoint` ({self.path})"
                if path == self.path
                else f"the file {path} of `checkpoint` ({self.path})"
            )
            raise BatchError(
                f"{where} was written by a different run:\n"
                + bullet_list(differences or ["its run id"])
                + "\nPass another path, or delete the checkpoint's files to start this "
                "run afresh."
            )

    def check_draw_file(self, entry: DrawFile) -> pathlib.Path:
        """The path of a listed draw file, checked to hold what the listing says."""
        path = self.path.with_name(entry.name)
        metadata = self.read_checked(path, "draw file")
        expected = tuple(entry.holds().values())
        holds = tuple(metadata.get(key) for key in entry.holds())
        if holds != expected:
            raise BatchError(
                f"the draw file {path} of `checkpoint` ({self.path}) holds chains "
                f"{holds[0]!r} and draws {holds[1]!r}, not {expected[0]} and "
                f"{expected[1]}: its files were mixed up."
            )
        return path

    # -- refusing ----------------------------------------------------------------------

    def damaged(self, problem: str) -> BatchError:
        """The error of a checkpoint of this run that cannot be resumed, because of
        `problem`."""
        return BatchError(
            f"`checkpoint` ({self.path}) cannot be resumed: {problem}. Delete its "
            "files to start afresh."
        )

    def unreadable(self, what: str, error: Exception) -> BatchError:
        """The error of the checkpoint's `what` ("draw file") that `error` stopped
        from being read."""
        if isinstance(error, ForeignFileError) and what == "checkpoint":
            # Not a file of ours: it may be the user's, so it is not to be deleted.
            return BatchError(
                f"`checkpoint` ({self.path}) is not an eqx_batch checkpoint: {error}\n"
                "Pass another path: `run_chains` would overwrite this file."
            )
        return BatchError(
            f"`checkpoint` ({self.path}) cannot be resumed: its {what} is unreadable. "
            f"{error}\nDelete the checkpoint's files (or pass another path) to start "
            "this run afresh."
        )
