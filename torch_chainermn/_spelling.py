"""An argument's old spelling, still taken with a DeprecationWarning naming the new one (the one helper
every module uses: the keywords of GradientCompression, the hooks, the communicator, the optimizer and
FSDP2's, and the keys of a `compression=` dict)."""

from __future__ import annotations

import warnings

__all__ = ["deprecated_spelling"]


def deprecated_spelling(
    op: str,
    new: str,
    old: str,
    new_value,
    old_value,
    unset=None,
    how: str = "it takes the same values",
    *,
    key_of: str | None = None,
    stacklevel: int = 3,
) -> tuple:
    """(the value given as `new=` or under its old spelling `old=`, the spelling used: what an error
    about it names). The old spelling warns (a DeprecationWarning naming the new one, and `how` to
    write it); both: a ValueError naming `op`. key_of: the two spellings are keys of the dict given as
    that argument (compression={"type": ...}), not keywords; stacklevel: the warning's, from the caller
    of the function that calls this one."""
    if old_value is unset:
        return new_value, new

    def spelled(name: str) -> str:
        return f'{key_of}["{name}"]' if key_of else f"{name}="

    if new_value is not unset:
        raise ValueError(f"{op}: give {spelled(new)} only ({spelled(old)} is its old spelling), not both")
    warnings.warn(
        f"{op}: {spelled(old)} is deprecated, use {spelled(new)} ({how})", DeprecationWarning, stacklevel=stacklevel
    )
    return old_value, old
