"""Writing output files safely: checked up front, written atomically, safe to open.

- ``check_writable_output(path)`` refuses, before any work, an output that could not
  be written at the end: a directory in the way, a parent that is not a directory or
  not writable (a read-only file system too), a missing parent that cannot be made.
- ``atomic_write(path, write)`` writes through a fresh temporary file in the target
  directory (``mkstemp``: a random name opened with O_EXCL, so a symlink or file planted
  at a predictable name is never followed or overwritten) and renames it into place;
  a reader sees the old file or the new one, never half of one. Any OSError (a full
  disk, a read-only file system, no permission) becomes ``OutputError``, one line.
- ``csv_text_cell`` / ``csv_text_value`` neutralise spreadsheet formulas in CSV text
  cells (see ``csv_text_cell``); ``write_csv`` writes rows so, atomically.

No heavy imports: the planner and the table writer share this.
"""

from __future__ import annotations

import csv
import io
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Any

from mlatune.errors import OutputError

# A spreadsheet evaluates a cell starting with one of these as a formula (OWASP's CSV
# injection list: = + - @, and tab and carriage return, which some strip first).
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
_QUOTE = "'"


def csv_text_cell(text: str) -> str:
    """A text cell as written to CSV: prefixed with ``'`` (OWASP's advice; a spreadsheet
    shows the text, not a formula) when it starts like a formula, or with ``'`` itself,
    so that ``csv_text_value`` undoes it exactly for every string."""
    return _QUOTE + text if text.startswith((*FORMULA_STARTS, _QUOTE)) else text


def csv_text_value(cell: str) -> str:
    """The text a CSV cell written by ``csv_text_cell`` holds."""
    return cell[1:] if cell.startswith(_QUOTE) else cell


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def check_writable_output(path: str | os.PathLike) -> None:
    """Refuse (OutputError) an output file that could not be written later.

    Checks, without writing anything where the output goes: ``path`` is not a
    directory, its nearest existing ancestor is a directory this process may create
    files in (``os.access``, which also says EROFS on a read-only file system), and
    when the parent exists, a temporary file can really be made there (ACLs, quotas,
    file systems that ``access`` misjudges). A full disk can still end the write; that
    is an OutputError then.
    """
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{path}: is a directory; name a file to write")
    parent = path.parent
    ancestor = parent
    while not ancestor.exists():
        if ancestor.is_symlink():  # a dangling link: mkdir cannot go through it
            raise OutputError(f"{path}: cannot create {ancestor}: a broken symbolic link")
        if ancestor.parent == ancestor:
            break
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputError(f"{path}: cannot create it: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        what = "write into" if ancestor == parent else f"create {parent} in"
        raise OutputError(f"{path}: cannot {what} {ancestor}: "
                          f"{'read-only file system' if _read_only(ancestor) else 'no permission'}")
    if ancestor == parent:
        _probe(path, parent)


def _read_only(directory: Path) -> bool:
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _probe(path: Path, parent: Path) -> None:
    """Make and remove one temporary file beside the output."""
    try:
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".probe")
    except OSError as exc:
        raise OutputError(f"{path}: cannot write into {parent}: {_why(exc)}") from None
    os.close(fd)
    os.unlink(tmp)


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], object], *,
                 make_parents: bool = True) -> Path:
    """Write a file atomically: ``write(handle)`` fills a fresh temporary file in the
    target directory (made first, with ``make_parents``), which is synced and renamed
    over ``path``. Raises OutputError (one line naming ``path``) on any OSError;
    nothing is left behind then."""
    path = Path(path)
    try:
        if make_parents:
            path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {_why(exc)}") from exc
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        # mkstemp makes the file owner-only; an output is meant to be shared like any file.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError) and not isinstance(exc, OutputError):
            raise OutputError(f"cannot write {path}: {_why(exc)}") from exc
        raise
    return path


def write_csv(path: str | os.PathLike, columns: Sequence[str], rows: Iterable[Sequence[Any]],
              *, make_parents: bool = False) -> Path:
    """A CSV file written atomically, every text cell through ``csv_text_cell`` (numbers
    as they are). For exports that are not tables (``mlatune plan --out``)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(columns)
    writer.writerows([csv_text_cell(v) if isinstance(v, str) else v for v in row]
                     for row in rows)
    text = buffer.getvalue().encode("utf-8")
    return atomic_write(path, lambda h: h.write(text), make_parents=make_parents)
