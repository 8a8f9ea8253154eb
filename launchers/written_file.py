"""A file mantra writes for the user (`plan --search --write BEST.yaml`, `new --from-hf DIR OUT.yaml`): checked
before anything is written, never over one of the command's inputs, and in place only once it is whole and valid.

    check_target(out, inputs=(manifest,), overwrite=True)   # OutputError: a directory, a device, an input, ...
    write_checked(out, text, validate)                      # a temp file beside `out`, validated, then renamed

A failed validation or write leaves `out` as it was (absent, or the earlier file): the temp file is removed.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path


class OutputError(ValueError):
    """Why `out` cannot be written, one line naming it and the fix."""


def check_target(out: Path, inputs: Iterable[Path] = (), overwrite: bool = True) -> None:
    """Refuse an `out` that is a directory or not a regular file, that names one of `inputs` (the same file, or a
    file inside an input directory), that exists when `overwrite` is False, or whose parent is not a directory."""
    if not str(out).strip():
        raise OutputError("the output file name is empty; name a .yaml file to write")
    resolved = out.resolve()
    for given in inputs:
        source = Path(given).resolve()
        if resolved == source or (source.is_dir() and source in resolved.parents):
            raise OutputError(f"{out} is {'inside ' if resolved != source else ''}the input {given}; "
                              "write to another file")
        if out.exists() and source.exists() and os.path.samefile(out, source):
            raise OutputError(f"{out} is the input {given} (a link to it); write to another file")
    if out.is_symlink() or out.exists():
        try:
            mode = out.lstat().st_mode
        except OSError as exc:
            raise OutputError(f"{out} cannot be examined ({exc.strerror}); choose another file") from None
        if stat.S_ISDIR(mode) or out.is_dir():
            raise OutputError(f"{out} is a directory; name a file inside it, e.g. {out / 'manifest.yaml'}")
        if not stat.S_ISREG(mode):
            raise OutputError(f"{out} is not a regular file; choose another file")
        if not overwrite:
            raise OutputError(f"{out} exists; choose another name, or pass --force to replace it")
    for parent in (out.parent, *out.parent.parents):
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise OutputError(f"{out}: {parent} is not a directory; choose another place")
            break


def write_checked(out: Path, text: str, validate: Callable[[Path], None] = lambda path: None) -> Path:
    """Write `text` to `out` through a temp file in the same directory, which `validate(temp)` sees first (relative
    paths in it resolve as they will in `out`); `out` itself is replaced only when validate returned. An error
    from validate, or an OSError, is an OutputError (the temp file's name replaced by `out`'s)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    except OSError as exc:
        raise OutputError(f"{out} cannot be written ({exc.strerror or exc}); choose another place") from None
    temp = Path(name)
    try:
        umask = os.umask(0)  # mkstemp made it 0600: give it the mode a plain write would (0666 less the umask)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        try:
            validate(temp)
        except Exception as exc:  # a ManifestError, usually: said with `out`'s name, nothing written
            said = str(exc).replace(str(temp), str(out)).replace(temp.name, out.name)
            raise OutputError(f"{out}: what would be written does not validate ({said}); nothing written") from None
        os.replace(temp, out)
    except OSError as exc:
        raise OutputError(f"{out} cannot be written ({exc.strerror or exc}); choose another place") from None
    finally:
        temp.unlink(missing_ok=True)
    return out
