"""The command line's checks of its options, before any work, each refusal one sentence naming the option as the
user typed it: a number has one range, which its --help states; a folder or file a command writes at its end must
be writable, and is then written whole or said not to be."""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from model.errors import InputError

MAX_LIST_VALUES = 8  # values of one comma-separated option (serve-bench times every combination of them)


def check_option(option: str, value: float, low: float, high: float) -> None:
    """InputError unless low <= value <= high (NaN is outside every range)."""
    if not low <= value <= high:
        raise InputError("option_range", option=option, low=low, high=high, value=value)


def check_list(option: str, values: list) -> None:
    """At most MAX_LIST_VALUES values, none twice."""
    if not 1 <= len(set(values)) == len(values) <= MAX_LIST_VALUES:
        raise InputError("option_list", option=option, most=MAX_LIST_VALUES, given=",".join(map(str, values)))


def read_bounded(path: str | Path, most: int) -> bytes:
    """At most `most` + 1 bytes of a regular file (a caller refuses more): a device such as /dev/zero or a FIFO is
    refused before a byte is read (OSError EINVAL), so a command never reads without end or waits for a writer."""
    with open(path, "rb", opener=lambda name, flags: os.open(name, flags | os.O_NONBLOCK)) as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        return file.read(most + 1)


PROBE = ".decode-lab-write-probe"


def _probe(folder: Path) -> None:
    """Make `folder` (and any missing parent) and write a probe file into it; what this made is removed again, so a
    refused or failed run leaves nothing behind. OSError where the folder cannot take a new file."""
    created = [p for p in (folder, *folder.parents) if not p.exists()]  # the deepest first
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / PROBE).write_bytes(b"")
        (folder / PROBE).unlink()
    finally:
        for made in created:
            with suppress(OSError):
                made.rmdir()


def save_target(path: str, overwrite: bool) -> Path:
    """The checkpoint folder, checked by making it and writing a probe into it."""
    if not path.strip():
        raise InputError("train_save_empty")
    folder = Path(path)
    try:
        if folder.exists() and not folder.is_dir():
            raise InputError("train_save_file", path=path)
        present = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        if present and not overwrite:
            raise InputError("train_save_not_empty", path=path, files=", ".join(present[:5]))
        _probe(folder)
    except OSError as failed:
        raise InputError("save_unwritable", option="--save", path=path, reason=failed.strerror or str(failed)) from None
    return folder


def file_target(path: str, overwrite: bool, option: str) -> Path:
    """A file that a command writes at its end, checked before its work as save_target checks a folder: a plain file
    (replaced only with --overwrite) or nothing yet, in a folder that exists and takes a new file."""
    if not path.strip():
        raise InputError("save_file_empty", option=option)
    target = Path(path)
    try:
        if target.exists() and not target.is_file():  # a folder, a device
            raise InputError("save_not_a_file", option=option, path=path)
        if target.exists() and not overwrite:
            raise InputError("save_file_exists", option=option, path=path)
        if not target.parent.is_dir():
            raise InputError("save_no_folder", option=option, path=path, folder=str(target.parent))
        _probe(target.parent)
    except OSError as failed:
        raise InputError("save_unwritable", option=option, path=path, reason=failed.strerror or str(failed)) from None
    return target


@contextmanager
def written_at_end(target: Path, option: str) -> Iterator[Path]:
    """A fresh path beside `target` for the block to write; when the block ends, the file written there replaces
    `target` in one step, and a file that was not written is said (InputError), never claimed. Nothing else stays
    behind, also when the block fails: neither the fresh path nor a writer's own temporary PATH.tmp beside it."""
    handle, name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(handle)
    partial = Path(name)
    partial.unlink()  # an empty file left there is not taken for one written
    try:
        yield partial
        try:
            os.replace(partial, target)  # FileNotFoundError when nothing was written there
        except OSError as failed:
            raise InputError("save_not_written", option=option, path=str(target),
                             reason=failed.strerror or str(failed)) from None
    finally:
        for leftover in (partial, partial.with_name(partial.name + ".tmp")):
            with suppress(OSError):
                leftover.unlink()
