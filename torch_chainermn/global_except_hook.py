"""End the whole job when any rank dies of an uncaught Python exception.

Without this, a rank that raises leaves its peers blocked in their next collective until the group
timeout (30 minutes by default), or forever under MPI. ChainerMN's answer, for PyTorch:

    import torch_chainermn.global_except_hook
    torch_chainermn.global_except_hook.add_hook()

or, with no code change, `CHAINERMN_FORCE_ABORT_ON_EXCEPTION=1` in the environment (ChainerMN's
manual also spells it `..._EXCEPTIONS`; both work).

On an uncaught exception (in the main thread or any other thread) the hook prints
"chainermn: uncaught exception on rank R of S:" and the traceback to stderr, flushes, and ends the job:
- under mpiexec: MPI_Abort on MPI_COMM_WORLD, which makes mpiexec kill every rank;
- otherwise (torchrun): os._exit(1) at once, skipping interpreter shutdown (which could block on the
  process group). The kernel closes this process's sockets and shared-memory peers see it gone, so
  peers blocked in a collective with it fail with a DistBackendError within moments instead of
  waiting for the group timeout; with the hook installed on every rank, those errors end them too.
  torchrun's agent also sees the failed worker and stops the rest.
"""

from __future__ import annotations

import io
import os
import sys
import threading
import traceback

from . import settings

__all__ = ["add_hook", "remove_hook", "hook_installed"]

EXIT_CODE = 1

# The hooks that were in place before add_hook(), restored by remove_hook().
_previous_excepthook = None
_previous_threading_excepthook = None


def _rank_and_size() -> tuple[str, str]:
    """This process's global rank and the world size, as text, from wherever they are known."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return str(dist.get_rank()), str(dist.get_world_size())
    except Exception:  # noqa: BLE001  the hook must never fail to print and abort
        pass
    try:
        from . import _launch

        return _launch.record().describe()
    except Exception:  # noqa: BLE001
        return "?", "?"


def _output_stream(current):
    """Where the report goes: sys.stderr when it is a real file, else the process's own stderr.

    torch's init_process_group wraps sys.excepthook in one that points sys.stderr at a StringIO while
    the previous hook (ours) runs, and prints it afterwards; we end the process before that, so text
    written to the StringIO would be lost.
    """
    try:
        current.fileno()
        return current
    except Exception:  # noqa: BLE001  io.UnsupportedOperation, AttributeError, a closed stream
        return sys.__stderr__ or current


def _report(print_traceback, exc_info, where: str = "") -> None:
    """Print the rank-prefixed traceback (through the previous hook, so its formatting is kept)."""
    rank, size = _rank_and_size()
    original_stderr = sys.stderr
    captured = io.StringIO()
    sys.stderr = captured
    try:
        print_traceback()
    except Exception:  # noqa: BLE001  a broken previous hook must not stop the report or the abort
        traceback.print_exception(*exc_info, file=captured)
    finally:
        sys.stderr = original_stderr
    text = captured.getvalue() or "".join(traceback.format_exception(*exc_info))
    report = f"chainermn: uncaught exception on rank {rank} of {size}{where}:\n{text}"
    if not report.endswith("\n"):
        report += "\n"
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001
        pass
    try:
        stream = _output_stream(original_stderr)
        stream.write(report)  # one write: less interleaving with the other ranks' reports
        stream.flush()
    except Exception:  # noqa: BLE001
        pass


def _end_job() -> None:
    """End every rank: MPI_Abort under mpiexec, else this process at once (its peers' ops then fail)."""
    try:
        from . import _launch

        if _launch.mpi_launched():
            from . import _C

            try:
                rank, size = _rank_and_size()
                stream = _output_stream(sys.stderr)
                stream.write(f"chainermn: rank {rank} calls MPI_Abort to end all {size} ranks\n")
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
            _C.mpi_abort(EXIT_CODE)  # does not return; exits even if MPI was never initialized
    finally:
        os._exit(EXIT_CODE)


def _global_excepthook(exc_type, exc_value, exc_traceback) -> None:
    def print_traceback():
        previous = _previous_excepthook or sys.__excepthook__
        previous(exc_type, exc_value, exc_traceback)

    try:
        _report(print_traceback, (exc_type, exc_value, exc_traceback))
    finally:
        _end_job()


def _global_threading_excepthook(args) -> None:
    if args.exc_type is SystemExit:
        # threading ignores SystemExit in a thread (it just ends that thread); so do we.
        (_previous_threading_excepthook or threading.__excepthook__)(args)
        return

    def print_traceback():
        previous = _previous_threading_excepthook or threading.__excepthook__
        previous(args)

    thread_name = getattr(args.thread, "name", None)
    try:
        _report(
            print_traceback,
            (args.exc_type, args.exc_value, args.exc_traceback),
            f" (thread {thread_name})" if thread_name else " (a thread)",
        )
    finally:
        _end_job()


def hook_installed() -> bool:
    """Whether add_hook()'s hooks are the current sys.excepthook and threading.excepthook."""
    return sys.excepthook is _global_excepthook and threading.excepthook is _global_threading_excepthook


def add_hook() -> None:
    """Install the global except hook (sys.excepthook and threading.excepthook). Idempotent.

    After this, an uncaught exception on any rank prints its traceback, prefixed with the rank, and
    ends every rank of the job within seconds (see the module's docstring).
    """
    global _previous_excepthook, _previous_threading_excepthook
    if sys.excepthook is not _global_excepthook:
        _previous_excepthook = sys.excepthook
        sys.excepthook = _global_excepthook
    if threading.excepthook is not _global_threading_excepthook:
        _previous_threading_excepthook = threading.excepthook
        threading.excepthook = _global_threading_excepthook


def remove_hook() -> None:
    """Restore the hooks that were in place before add_hook(). A no-op when not installed.

    A hook someone installed on top of ours is left in place.
    """
    global _previous_excepthook, _previous_threading_excepthook
    if sys.excepthook is _global_excepthook:
        sys.excepthook = _previous_excepthook or sys.__excepthook__
        _previous_excepthook = None
    if threading.excepthook is _global_threading_excepthook:
        threading.excepthook = _previous_threading_excepthook or threading.__excepthook__
        _previous_threading_excepthook = None


def _install_from_environment() -> bool:
    """Install the hook if CHAINERMN_FORCE_ABORT_ON_EXCEPTION is set to anything but "" or "0".

    Called when torch_chainermn is imported. Returns whether the hook was installed.
    """
    if settings.abort_on_exception_requested():
        add_hook()
        return True
    return False
