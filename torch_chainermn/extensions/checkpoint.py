"""The multi-node checkpointer: per-rank snapshots written atomically, verified, agreed on, collected."""

from __future__ import annotations

import hashlib
import io
import os
import re
import struct
import tempfile

import torch
import torch.distributed as dist

from .._backend import group_of

__all__ = ["MultiNodeCheckpointer", "create_multi_node_checkpoint", "create_multi_node_checkpointer"]


# File layout: a fixed header, then the payload (torch.save's bytes).
#   magic (8 bytes) | format version (u32) | iteration (u64) | payload length (u64) | sha256 (32 bytes)
# The digest covers the header fields before it and the payload, so any damaged byte, a file cut
# short, or a file renamed to another iteration is detected and never loaded.
_MAGIC = b"TCMNCKPT"
_FORMAT_VERSION = 1
_HEADER_FIELDS = struct.Struct("<8sIQQ")
_DIGEST_SIZE = 32
_HEADER_SIZE = _HEADER_FIELDS.size + _DIGEST_SIZE


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_directory(path: str) -> None:
    """Make a rename in `path` durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class CheckpointCorrupted(Exception):
    """A checkpoint file failed its integrity check (internal: such files are skipped, not loaded)."""


class MultiNodeCheckpointer:
    """Generational snapshots of every rank's state, and resumption from the newest complete one.

    Made by `create_multi_node_checkpointer`; see there.

    Attributes: `name`, `path` (absolute), `rank`, `size`, `cp_interval`, `gc_interval`,
    `saves_since_gc`, `last_saved_iteration`, `loaded_iteration`.
    """

    def __init__(self, name: str, comm=None, cp_interval: int = 5, gc_interval: int = 5, path=None):
        op = "create_multi_node_checkpointer"
        if not isinstance(name, str) or not name or os.sep in name or (os.altsep and os.altsep in name):
            raise ValueError(f"{op}: name must be a non-empty file name without path separators, got {name!r}")
        for argument, value in (("cp_interval", cp_interval), ("gc_interval", gc_interval)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{op}: {argument} must be an int >= 1, got {value!r}")
        self.name = name
        self.comm = comm
        self.cp_interval = cp_interval
        self.gc_interval = gc_interval
        self.group = group_of(comm, op)
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.path = os.path.abspath(os.fspath(path) if path is not None else os.getcwd())
        os.makedirs(self.path, exist_ok=True)
        self.saves_since_gc = 0
        self.last_saved_iteration = None
        self.loaded_iteration = None
        prefix = re.escape(f"{name}.{self.rank}.")
        self._final_pattern = re.compile(prefix + r"(\d+)")
        self._temporary_pattern = re.compile(prefix + r"\d+\.tmp-.*")

    # ---- file names ----------------------------------------------------------------------------

    def filename(self, iteration: int, rank: int | None = None) -> str:
        """The path of `rank`'s (default: this rank's) snapshot of `iteration`."""
        return os.path.join(self.path, f"{self.name}.{self.rank if rank is None else rank}.{iteration}")

    def _own_files(self):
        """(iteration or None for a temporary file, file name) for every file of this rank."""
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return
        for file_name in names:
            final = self._final_pattern.fullmatch(file_name)
            if final:
                yield int(final.group(1)), file_name
            elif self._temporary_pattern.fullmatch(file_name):
                yield None, file_name

    def iterations(self) -> list[int]:
        """This rank's snapshots whose header and length are intact, oldest first.

        The digest is checked when a snapshot is loaded (reading every file in full here would cost
        as much as loading them all).
        """
        intact = []
        for iteration, file_name in self._own_files():
            if iteration is not None and self._header_intact(os.path.join(self.path, file_name), iteration):
                intact.append(iteration)
        return sorted(intact)

    # ---- file format ---------------------------------------------------------------------------

    @staticmethod
    def _header_fields(iteration: int, payload_length: int) -> bytes:
        return _HEADER_FIELDS.pack(_MAGIC, _FORMAT_VERSION, iteration, payload_length)

    @staticmethod
    def _header_intact(file_path: str, iteration: int) -> bool:
        try:
            with open(file_path, "rb") as f:
                header = f.read(_HEADER_FIELDS.size)
                size = os.fstat(f.fileno()).st_size
        except OSError:
            return False
        if len(header) != _HEADER_FIELDS.size:
            return False
        magic, version, stored_iteration, payload_length = _HEADER_FIELDS.unpack(header)
        return (
            magic == _MAGIC
            and version == _FORMAT_VERSION
            and stored_iteration == iteration
            and size == _HEADER_SIZE + payload_length
        )

    @staticmethod
    def _read_verified(file_path: str, iteration: int) -> bytes:
        """The payload of a snapshot file, or CheckpointCorrupted if any byte of it is wrong."""
        with open(file_path, "rb") as f:
            data = f.read()
        if len(data) < _HEADER_SIZE:
            raise CheckpointCorrupted(f"{file_path}: {len(data)} bytes, shorter than the header")
        fields = data[: _HEADER_FIELDS.size]
        magic, version, stored_iteration, payload_length = _HEADER_FIELDS.unpack(fields)
        if magic != _MAGIC or version != _FORMAT_VERSION:
            raise CheckpointCorrupted(f"{file_path}: not a torch_chainermn checkpoint (format {version})")
        if stored_iteration != iteration:
            raise CheckpointCorrupted(f"{file_path}: holds iteration {stored_iteration}")
        if len(data) != _HEADER_SIZE + payload_length:
            raise CheckpointCorrupted(f"{file_path}: {len(data)} bytes, expected {_HEADER_SIZE + payload_length}")
        stored_digest = data[_HEADER_FIELDS.size : _HEADER_SIZE]
        payload = memoryview(data)[_HEADER_SIZE:]
        digest = hashlib.sha256(fields)
        digest.update(payload)
        if digest.digest() != stored_digest:
            raise CheckpointCorrupted(f"{file_path}: sha256 mismatch")
        return payload

    # ---- save ----------------------------------------------------------------------------------

    def save(self, state, iteration: int) -> str:
        """Write `state` (anything torch.save accepts) as this rank's snapshot of `iteration`.

        The file is written to a temporary name in the same directory, fsynced, renamed into place
        and the directory fsynced, so a crash at any point never leaves a partial file under a
        snapshot's name. Every `gc_interval` saves, old snapshots are collected; that step is
        collective, so every rank must save equally often (as training in lockstep does).
        Returns the snapshot's path.
        """
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
            raise ValueError(f"MultiNodeCheckpointer.save: iteration must be an int >= 0, got {iteration!r}")
        buffer = io.BytesIO()
        torch.save(state, buffer)
        payload = buffer.getbuffer()
        fields = self._header_fields(iteration, len(payload))
        digest = hashlib.sha256(fields)
        digest.update(payload)

        final_path = self.filename(iteration)
        fd, temporary_path = tempfile.mkstemp(dir=self.path, prefix=f"{self.name}.{self.rank}.{iteration}.tmp-")
        try:
            # mkstemp makes the file 0600; give it the mode an ordinary file would get under the umask,
            # so a job resumed by another user of a shared file system can read it.
            os.fchmod(fd, 0o666 & ~_current_umask())
            with os.fdopen(fd, "wb") as f:
                f.write(fields)
                f.write(digest.digest())
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary_path, final_path)
        except BaseException:
            try:
                os.unlink(temporary_path)
            except OSError:
                pass
            raise
        _fsync_directory(self.path)
        self.last_saved_iteration = iteration

        self.saves_since_gc += 1
        if self.saves_since_gc >= self.gc_interval:
            self.collect_garbage()
        return final_path

    # ChainerMN's extension was called to save.
    __call__ = save

    def _common_iterations(self) -> list[int]:
        """Iterations that every rank holds an (apparently) intact snapshot of, oldest first."""
        listings = [None] * self.size
        dist.all_gather_object(listings, self.iterations(), group=self.group)
        common = set(listings[0])
        for listing in listings[1:]:
            common &= set(listing)
        return sorted(common)

    def collect_garbage(self) -> None:
        """Keep the newest `cp_interval` snapshots that every rank holds; delete this rank's older ones.

        This rank's snapshots newer than the oldest kept one stay (they may yet become common), and so
        does everything when fewer than `cp_interval` common snapshots exist. Temporary files this
        rank left behind (a crash mid-save) and snapshots of this rank whose header or length is wrong
        are removed. Collective.
        """
        self.saves_since_gc = 0
        intact = set(self.iterations())
        common = self._common_iterations()
        oldest_kept = common[-self.cp_interval] if len(common) >= self.cp_interval else None
        for iteration, file_name in list(self._own_files()):
            # Snapshots are renamed into place only once complete, so a snapshot whose header or
            # length is wrong was damaged afterwards and can never be loaded: it goes too.
            if iteration is None or iteration not in intact or (oldest_kept is not None and iteration < oldest_kept):
                self._remove(file_name)

    def _remove(self, file_name: str) -> None:
        try:
            os.unlink(os.path.join(self.path, file_name))
        except FileNotFoundError:
            pass

    # ---- load ----------------------------------------------------------------------------------

    def maybe_load(self, map_location=None, weights_only: bool = True):
        """Load the newest snapshot that every rank holds intact: returns (state, iteration).

        Returns (None, 0) when the ranks have no intact snapshot in common (a fresh start). The ranks
        agree on the candidate, each verifies its file's digest and deserializes it, and if any rank
        fails the check the next older common iteration is tried. Collective.
        `map_location` and `weights_only` are passed to torch.load; pass weights_only=False for
        states holding arbitrary Python objects (trusted files only).
        """
        candidates = self._common_iterations()
        while candidates:
            iteration = candidates.pop()
            state, problem, error = None, None, None
            try:
                payload = self._read_verified(self.filename(iteration), iteration)
                state = torch.load(io.BytesIO(payload), map_location=map_location, weights_only=weights_only)
            except (CheckpointCorrupted, OSError) as damaged:
                problem = str(damaged)
            except Exception as failure:  # noqa: BLE001  raised below, once every rank knows
                error = failure
            outcomes = [None] * self.size
            dist.all_gather_object(
                outcomes, (problem, f"{type(error).__name__}: {error}" if error else None), group=self.group
            )
            if error is not None:
                raise error
            errors = [f"rank {r}: {e}" for r, (_, e) in enumerate(outcomes) if e is not None]
            if errors:
                raise RuntimeError(
                    f"MultiNodeCheckpointer.maybe_load: loading iteration {iteration} failed on " + "; ".join(errors)
                )
            if all(p is None for p, _ in outcomes):
                self.loaded_iteration = iteration
                return state, iteration
            # Some rank's copy is damaged: this iteration cannot be resumed from; try an older one.
            state = None
        self.loaded_iteration = None
        return None, 0

    # ---- finalize ------------------------------------------------------------------------------

    def finalize(self) -> None:
        """Remove this rank's snapshots and temporary files, once every rank has got here.

        Call after training finished without errors. The barrier first makes sure no rank deletes
        its snapshots while another may still fail and need the job restarted from them. Collective.
        """
        dist.barrier(group=self.group)
        for _, file_name in list(self._own_files()):
            self._remove(file_name)
        _fsync_directory(self.path)


def create_multi_node_checkpointer(
    name: str, comm=None, cp_interval: int = 5, gc_interval: int = 5, path=None
) -> MultiNodeCheckpointer:
    """ChainerMN's generational multi-node checkpointer, for PyTorch state dicts.

    Each rank writes its snapshots as `<path>/<name>.<rank>.<iteration>` (path defaults to the current
    directory and is created), and the job resumes from the newest iteration that every rank holds
    intact:

        checkpointer = create_multi_node_checkpointer("run-42", comm, path="snapshots")
        state, start = checkpointer.maybe_load()          # (None, 0) on a fresh start
        if state is not None:
            model.load_state_dict(state["model"]); optimizer.load_state_dict(state["optimizer"])
        for iteration in range(start + 1, total + 1):
            train_one_step()
            checkpointer.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, iteration)
        checkpointer.finalize()                           # training succeeded: remove the snapshots

    Writes are atomic (temporary file + fsync + rename) and every file carries a sha256 digest, so a
    file cut short by a crash or damaged on disk is detected and never loaded. Every `gc_interval`
    saves, snapshots older than the newest `cp_interval` common ones are deleted (ChainerMN ignored
    gc_interval). `save` (every gc_interval-th call), `maybe_load` and `finalize` are collective.
    """
    return MultiNodeCheckpointer(name, comm, cp_interval, gc_interval, path)


# ChainerMN's name for it.
create_multi_node_checkpoint = create_multi_node_checkpointer
