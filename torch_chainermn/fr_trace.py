"""torch's flight-recorder analyzer for chainermn's dumps:

    python -m torch_chainermn.fr_trace DIR [torch's options: -j, --selected-ranks, -o, ...]

is `python -m torch.distributed.flight_recorder.fr_trace` (`torchfrtrace`), unchanged except that it
accepts the profiling names of chainermn's ops ("chainermn:all_reduce"). torch's analyzer admits only
its own libraries' prefixes (nccl, gloo, ...), listed inside its `Op` class in torch 2.12, 2.13 and 2.14
(torch/distributed/flight_recorder/components/types.py): an entry of chainermn's is read as the same op
of gloo's, then keeps its own name for the report.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence

PREFIX = "chainermn:"
_READ_AS = "gloo:"  # a prefix every supported torch's analyzer accepts


def admit_chainermn(op_class) -> None:
    """Makes torch's `Op` (the analyzer's parse of one entry) read chainermn's entries. Idempotent."""
    init = op_class.__init__
    if getattr(init, "admits_chainermn", False):
        return

    @functools.wraps(init)
    def __init__(self, event, *args, **kwargs):
        name = event["profiling_name"]
        if not name.startswith(PREFIX):
            return init(self, event, *args, **kwargs)
        init(self, {**event, "profiling_name": _READ_AS + name[len(PREFIX) :]}, *args, **kwargs)
        self.profiling_name = name

    __init__.admits_chainermn = True
    op_class.__init__ = __init__


def main(args: Sequence[str] | None = None) -> None:
    try:
        from torch.distributed.flight_recorder import fr_trace
        from torch.distributed.flight_recorder.components import types
    except ImportError as error:
        raise SystemExit(f"torch_chainermn.fr_trace: this torch has no flight-recorder analyzer ({error})")
    if not hasattr(types, "Op"):
        raise SystemExit(
            "torch_chainermn.fr_trace: this torch's analyzer has no Op class to admit chainermn's "
            "entries into (torch 2.12 to 2.14 have one)"
        )
    admit_chainermn(types.Op)
    fr_trace.main(args)


if __name__ == "__main__":
    main(sys.argv[1:])
