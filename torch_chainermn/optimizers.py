"""ChainerMN's multi-node optimizer: data parallelism for training loops without DDP.

    optimizer = torch_chainermn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()

The first step() broadcasts rank 0's parameters and does not update, so every rank starts from the
same model; later steps average the gradients over the group (one packed call, in the group's
allreduce_grad_dtype) and then step the wrapped optimizer. If the set of parameters changes, the
next step broadcasts again. With double_buffering=True, step k hands step k-1's averaged gradients to
the optimizer while step k's own allreduce runs in the background, overlapping the next forward and
backward: the second step does not update, and step k >= 3 applies the mean of step k-1's gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._backend import group_of, wire_dtype_of
from ._double_buffering import BackgroundMean, start_mean
from ._means import KeepsMean, deprecated_spelling, resolve
from .communicator import Communicator
from ._layouts import layout_of

__all__ = ["create_multi_node_optimizer", "MultiNodeOptimizer"]


def create_multi_node_optimizer(
    optimizer, communicator=None, double_buffering=False, zero_fill=True, compression=None, *, gradient_compression=None
):
    """Wrap a torch optimizer so that its step() averages gradients over `communicator`.

    communicator: a torch_chainermn communicator, a chainermn process group, or None for the
        default group. Its allreduce_grad_dtype is the wire dtype of the gradients.
    double_buffering: overlap each step's allreduce with the next step (one step stale).
    zero_fill: a parameter whose .grad is None takes part as zeros, and gets the mean written back
        (False: it is skipped, and then every rank must have None for it).
    compression: compression between nodes ({"code": "int8"}, MXNet's {"code": "2bit", "threshold": 0.5},
        or a compression.GradientCompression); None takes the communicator's compression, if any.
        `gradient_compression=` is its old spelling.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"create_multi_node_optimizer: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    compression, argument = deprecated_spelling(
        "create_multi_node_optimizer", "compression", "gradient_compression", compression, gradient_compression
    )
    return MultiNodeOptimizer(optimizer, communicator, double_buffering, zero_fill, compression, argument=argument)


def _parameters(optimizer) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]


class _InFlight:
    """One step's gradients being averaged in the background, and the parameters they belong to."""

    __slots__ = ("params", "mean")

    def __init__(self, params, mean: BackgroundMean):
        self.params = params
        self.mean = mean


class MultiNodeOptimizer(KeepsMean, torch.optim.Optimizer):
    """A torch optimizer whose step() is ChainerMN's multi-node update (see the module docstring).

    It shares the wrapped optimizer's param_groups and state, so LR schedulers, state_dict() and
    load_state_dict() work on it as on the wrapped one. Made by create_multi_node_optimizer.
    """

    # Optimizer.__init__ is not called on purpose: parameters, groups and state belong to the
    # wrapped optimizer and are shared by reference, so there is one truth for schedulers and saving.
    def __init__(
        self,
        optimizer,
        communicator=None,
        double_buffering=False,
        zero_fill=True,  # noqa: D107
        compression=None,
        *,
        argument: str = "compression",
    ):
        op = "create_multi_node_optimizer"
        self.actual_optimizer = optimizer
        if compression is None and isinstance(communicator, Communicator):
            self.mean, self.group = communicator.mean, communicator.group
        else:  # a GradientCompression brings its group; a communicator given too must be on it
            group = None if communicator is None else group_of(communicator, op)
            self.mean, self.group = resolve(compression, group, op, argument=argument, dtypes=False)
        self.double_buffering = bool(double_buffering)
        self.zero_fill = bool(zero_fill)
        self.world_size = self.group.size()
        self._broadcast_ids = None  # ids of the parameters as last broadcast
        self._in_flight = None  # double buffering: the previous step's allreduce
        self._spare = None  # double buffering: a read mean's buffer, for reuse

    # ---- what an Optimizer shares with the wrapped one -------------------------------------------

    @property
    def param_groups(self):
        return self.actual_optimizer.param_groups

    @property
    def state(self):
        return self.actual_optimizer.state

    @property
    def defaults(self):
        return self.actual_optimizer.defaults

    def __getattr__(self, name):
        # Only reached for names this class lacks: the wrapped optimizer's own extras.
        if name == "actual_optimizer":
            raise AttributeError(name)
        return getattr(self.actual_optimizer, name)

    def __getstate__(self):
        raise TypeError(
            "MultiNodeOptimizer cannot be pickled (it holds a process group); save optimizer.state_dict() instead"
        )

    def __repr__(self):
        return (
            f"MultiNodeOptimizer(double_buffering={self.double_buffering}, zero_fill={self.zero_fill}, "
            f"wire_dtype={wire_dtype_of(self.group)}, {self.actual_optimizer!r})"
        )

    def state_dict(self):
        return self.actual_optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.actual_optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True):
        self.actual_optimizer.zero_grad(set_to_none)

    def add_param_group(self, param_group):
        self.actual_optimizer.add_param_group(param_group)

    # ---- the multi-node update -------------------------------------------------------------------

    @torch.no_grad()
    def _broadcast_parameters(self, params) -> None:
        """Every rank takes rank 0's parameters: one coalesced broadcast."""
        tensors = [p.data for p in params]
        if tensors:
            # The root is a rank of the group (0), as DDP passes it.
            dist._broadcast_coalesced(self.group, tensors, 256 * 1024 * 1024, 0)

    def _gradients(self, params) -> tuple[list, list]:
        """The parameters taking part in the mean, and their gradients (zeros where None, with zero_fill)."""
        used, grads = [], []
        for p in params:
            if p.grad is None:
                if not self.zero_fill:
                    continue
                p.grad = torch.zeros_like(p)
            used.append(p)
            grads.append(p.grad)
        return used, grads

    def step(self, closure=None):
        """Evaluate `closure` if given, then broadcast (first call, or new parameters) or update."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = _parameters(self.actual_optimizer)
        ids = [id(p) for p in params]
        if ids != self._broadcast_ids:
            self._drop_in_flight()
            self._broadcast_parameters(params)
            self._broadcast_ids = ids
            return loss
        if self.double_buffering:
            self._double_buffered_update(params)
        else:
            used, grads = self._gradients(params)
            if grads:
                self.mean.start(grads, layout_of(grads, used)).wait()
            self.actual_optimizer.step()
        return loss

    # ---- double buffering ------------------------------------------------------------------------

    def _drop_in_flight(self) -> None:
        if self._in_flight is not None:
            self._in_flight.mean.wait()  # never leave a collective unmatched
            self._in_flight = None

    @torch.no_grad()
    def _launch(self, params) -> _InFlight | None:
        """Copy this step's gradients aside and start their mean in the background."""
        used, grads = self._gradients(params)
        if not grads:
            return None
        spare, self._spare = self._spare, None
        mean = start_mean(grads, self.mean, reuse=spare, params=layout_of(grads, used))
        return _InFlight(used, mean)

    @torch.no_grad()
    def _apply(self, finished: _InFlight) -> None:
        """Write the previous step's mean into the gradients, parameter by parameter."""
        for p in finished.params:
            if p.grad is None:  # skipped this step (zero_fill=False) but averaged the step before
                p.grad = torch.empty_like(p, memory_format=torch.contiguous_format)
        finished.mean.unpack([p.grad for p in finished.params])
        self._spare = finished.mean.buffer

    def _double_buffered_update(self, params) -> None:
        finished = self._in_flight
        self._in_flight = self._launch(params)
        if finished is None:
            return  # the first step after a broadcast: nothing averaged yet, no update
        self._apply(finished)
        self.actual_optimizer.step()

    def flush(self) -> None:
        """Wait for the allreduce in flight (e.g. before saving). Its mean is still applied next step."""
        if self._in_flight is not None:
            self._in_flight.mean.wait()
