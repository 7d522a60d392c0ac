"""MultiNodeChainList: a model split over processes, one list of components per rank (ChainerMN's).

    class Model0(torch_chainermn.MultiNodeChainList):       # on rank 0
        def __init__(self, comm):
            super().__init__(comm)
            self.add_link(MLP(784, 100, 100), rank_in=None, rank_out=1)   # input -> rank 1
            self.add_link(MLP(100, 100, 10), rank_in=1, rank_out=None)    # rank 1 -> output

    class Model1(torch_chainermn.MultiNodeChainList):       # on rank 1
        def __init__(self, comm):
            super().__init__(comm)
            self.add_link(MLP(100, 100, 100), rank_in=0, rank_out=0)

forward runs the components in the order they were added: a component with rank_in receives its
input from those ranks (else it takes forward's inputs), and one with rank_out sends its output
there (else its output is the model's). The delegate variables that keep the graph connected across
components are handled here, so one backward from what forward returns runs every component's
backward in reverse order, without deadlock. forward returns the model output, pseudo-connected to
the last delegate when an earlier component produced it, or the last delegate variable when this
rank has no output: backprop from it either way (loss.backward(), or phi.backward()).

Pipelining (beyond ChainerMN): with `micro_batches=m`, forward splits the batch (dim 0 of every
tensor input) into m micro-batches and runs the components once per micro-batch, with sends posted
asynchronously, so a rank computes micro-batch k+1 while its successor works on micro-batch k; the
outputs are concatenated again. One backward then runs the micro-batches' backward passes in reverse
order on every rank (GPipe), each stage sending its gradients on while it computes the next, and
the gradients equal the unpipelined chain's (to rounding). `step()` runs a whole training step with
a schedule (GPipe or 1F1B), as torch.distributed.pipelining's schedules do: see pipeline.py.
"""

from __future__ import annotations

import queue

import numpy as np
import torch

from ..messages import tensors as wire
from .._arguments import as_communicator, differentiable
from ..functions.point_to_point import recv, send_activation
from ..functions.pseudo_connect import pseudo_connect
from . import pipeline

USAGE = "MultiNodeChainList(comm)"
SCHEDULES = ("gpipe", "1f1b")


def _ranks(op: str, name: str, value, comm) -> tuple[int, ...] | None:
    """rank_in / rank_out as a tuple of ranks (or None): an int, a list of ints, or None."""
    if value is None:
        return None
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values:
        raise ValueError(f"{op}: {name} must be None, an int or a non-empty list of ints, got {value!r}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v < comm.size:
            raise ValueError(f"{op}: {name} must hold ranks in [0, {comm.size}) on rank {comm.rank}, got {value!r}")
    return tuple(int(v) for v in values)


def hang(delegate, value):
    """`value` (a tensor or a tuple) with `delegate`'s backward tied behind it (pseudo_connect on all of
    its differentiable tensors, so the delegate's backward runs once all of them have their gradient)."""
    if delegate is None:
        return value
    if isinstance(value, torch.Tensor):
        return pseudo_connect(delegate, value)
    items = list(value)
    slots = [i for i, v in enumerate(items) if isinstance(v, torch.Tensor) and differentiable(v.dtype)]
    if not slots:
        raise ValueError(
            "MultiNodeChainList: a component's inputs hold no floating tensor to carry the "
            "backward of the component before it"
        )
    connected = pseudo_connect(delegate, *[items[i] for i in slots])
    connected = connected if isinstance(connected, tuple) else (connected,)
    for i, v in zip(slots, connected):
        items[i] = v
    return tuple(items)


def _call(module, x):
    return module(*x) if isinstance(x, tuple) else module(x)


class MultiNodeChainList(torch.nn.Module):
    """Components of a model on this rank, chained with the other ranks' (ChainerMN's MultiNodeChainList).

    comm: a torch_chainermn Communicator, a chainermn ProcessGroup or None (the default group).
    micro_batches: split each batch into this many micro-batches and pipeline them (1: ChainerMN's
        behaviour). schedule: what `step()` runs, "gpipe" or "1f1b" (forward always pipelines as GPipe).
    input_gradients_first: in `step()`, the rank with the model output computes the gradients of what
        it received for the last micro-batch first and sends them, then its weights' gradients, so
        the stage before it starts its last backward that much sooner (pipeline.py). Costs that
        stage one more pass of input gradients, and backward hooks on its tensors or modules run
        twice for that micro-batch; the gradients are the same.
    """

    def __init__(self, comm=None, micro_batches: int = 1, schedule: str = "gpipe", input_gradients_first: bool = False):
        super().__init__()
        op = "MultiNodeChainList"
        self._comm = as_communicator(op, comm, USAGE)
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, (int, np.integer)) or micro_batches < 1:
            raise ValueError(f"{op}: micro_batches must be an int >= 1, got {micro_batches!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"{op}: schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        if not isinstance(input_gradients_first, bool):
            raise ValueError(f"{op}: input_gradients_first must be a bool, got {input_gradients_first!r}")
        self.micro_batches = int(micro_batches)
        self.schedule = schedule
        self.input_gradients_first = input_gradients_first
        self._rank_inouts: list[tuple] = []
        self._stages = None  # (stage index, number of stages), found by the first 1F1B step

    @property
    def comm(self):
        return self._comm

    def add_link(self, link: torch.nn.Module, rank_in=None, rank_out=None) -> None:
        """Register `link` (a torch.nn.Module), which receives its input from `rank_in` (an int, a list
        of ints, or None: forward's inputs) and sends its output to `rank_out` (likewise; None: the
        model's output). A rank may name itself: the value is handed over in this process."""
        op = "add_link"
        if not isinstance(link, torch.nn.Module):
            raise ValueError(f"{op}: link must be a torch.nn.Module, got {type(link).__name__}")
        rank_in = _ranks(op, "rank_in", rank_in, self._comm)
        rank_out = _ranks(op, "rank_out", rank_out, self._comm)
        self.add_module(str(len(self._rank_inouts)), link)
        self._rank_inouts.append((rank_in, rank_out))

    def components(self):
        """(module, rank_in, rank_out) in the order they were added."""
        return [(getattr(self, str(i)), rank_in, rank_out) for i, (rank_in, rank_out) in enumerate(self._rank_inouts)]

    def has_output(self) -> bool:
        """Whether forward returns a model output on this rank (else a delegate variable)."""
        return any(rank_out is None for _, rank_out in self._rank_inouts)

    # ---- one pass over the components (ChainerMN's __call__) ----
    def run_components(self, *inputs, gradients_ahead: bool = False, received: list | None = None):
        """Run every component once: (what forward returns, whether it is a model output).
        `gradients_ahead`: the caller will surely run this pass's backward (a pipeline schedule), so
        each send posts the receive of its gradient at once. `received`: gets what each recv from
        another rank returned."""
        comm = self._comm
        handed = queue.Queue()  # values a component sends to this very rank
        y, delegate, y_is_last = None, None, False
        for i, (f, rank_in, rank_out) in enumerate(self.components()):
            if rank_in is None:
                # The first component takes the inputs as they are; a later one must keep the backward
                # path to the components before it.
                x = f(*inputs) if i == 0 else _call(f, hang(delegate, inputs))
            else:
                xs = []
                for source in rank_in:
                    if source == comm.rank:
                        value = hang(delegate, handed.get())
                    else:
                        value = recv(comm, source, delegate_variable=delegate)
                        if received is not None:
                            received.append(value)
                    xs.append(value)
                    # The next receive hangs on this one: the earlier component's backward runs last.
                    delegate = as_delegate(value)
                delegate = None  # the inputs carry the path now: each edge backward exactly once
                x = f(*xs)
            if rank_out is None:
                if y is not None:
                    raise ValueError(
                        "MultiNodeChainList: only one component per rank may have rank_out=None "
                        f"(rank {comm.rank} has several)"
                    )
                y, y_is_last = x, True
                delegate = as_delegate(y)
                continue
            y_is_last = False
            for j, target in enumerate(rank_out):
                if j > 0 or target == comm.rank:
                    x = hang(delegate, x)  # sends run backward in reverse order, one after another
                if target == comm.rank:
                    handed.put(x)
                    delegate = as_delegate(x)
                else:
                    delegate = send_activation(x, comm, target, gradients_ahead=gradients_ahead)
        if not handed.empty():
            raise ValueError(
                "MultiNodeChainList: a value sent to this rank itself was never received "
                f"(rank {comm.rank}): make sure every rank_in and rank_out correspond"
            )
        if y is not None:
            return (y if y_is_last else hang(delegate, y)), True
        return delegate, False

    def forward(self, *inputs):
        wire.drain(self._comm)  # the previous step's messages have all arrived (and errors surface)
        if self.micro_batches == 1:
            return self.run_components(*inputs)[0]
        return pipeline.gpipe_forward(self, inputs, self.micro_batches)

    def step(self, *inputs, target=None, loss_fn=None, losses: list | None = None):
        """One training step of the pipeline: forward and backward of every micro-batch, scheduled by
        `self.schedule` ("gpipe" or "1f1b"), as torch.distributed.pipelining's `schedule.step`.

        The rank with the model output computes `loss_fn(output, target)` per micro-batch (target is
        split like the inputs; without target, `loss_fn(output)`), scaled by the micro-batch's share
        of the batch, so with a mean loss the gradients are those of one backward of the whole batch.
        Returns the batch's loss there (and appends each micro-batch's loss to `losses`), else None.
        Gradients accumulate into .grad; step the optimizer afterwards.
        """
        wire.drain(self._comm)
        result = pipeline.run_schedule(self, inputs, target, loss_fn, losses)
        wire.drain(self._comm)
        return result


def as_delegate(value):
    """A tensor whose backward reaches every differentiable tensor of `value` (a tensor or a tuple):
    what a later recv or pseudo_connect hangs on."""
    if value is None or isinstance(value, torch.Tensor):
        return value
    tensors = [v for v in value if isinstance(v, torch.Tensor) and differentiable(v.dtype)]
    if not tensors:
        return None
    joined = tensors[0]
    for t in tensors[1:]:
        joined = pseudo_connect(t, joined)
    return joined
