"""DDP whose gradient exchange runs on into the next forward, with no staleness (ByteScheduler, P3).

DDP overlaps each bucket's allreduce with the rest of backward only: the step waits for the last
bucket, then the optimizer runs. Here every bucket's mean goes on in the background past the end of
backward, and the optimizer steps a parameter only when the next forward reaches the module that
owns it: each module's forward pre-hook waits for its own parameters' buckets, writes their mean into
`.grad`, steps them and clears their gradients. The next forward starts while later layers' means are
still in flight; each layer waits only for its own. With a float32 wire, the parameters after every
step are bit for bit those of DDP with the same optimizer (the same mean: each gradient times 1/world
size, then summed, as DDP's reducer does; the same per-parameter update).

    ddp = DistributedDataParallel(model)                      # on a chainermn group
    optimizer = torch_chainermn.OverlapNextForward(ddp, torch.optim.AdamW, lr=1e-3)
    for x, y in batches:
        loss_fn(ddp(x), y).backward()
        optimizer.step()        # the update, with the hyperparameters it has now, in the next forward
        optimizer.zero_grad()   # nothing to do: a parameter's gradient is cleared when it is stepped
    optimizer.finish()          # the last step's update (also before a checkpoint)

It stands where the optimizer stood: `param_groups` (every parameter's group: a learning-rate
schedule sets them as usual), `step()`, `zero_grad()`, `state_dict()`, `load_state_dict()`.

The optimizer: one instance of `optimizer_class(**kwargs)` per parameter (torch's optimizers update
each parameter from its own gradient and state). Clipping by the global gradient norm is not
available: it needs every gradient before the first update, which is what this avoids (clip per
parameter, or use plain DDP). A parameter DDP leaves without a gradient (unused on every rank, with
find_unused_parameters=True) is not stepped, as in plain DDP. Checkpoints: `finish()`, then `ddp.state_dict()` and
`overlap.state_dict()` (every parameter's optimizer state, by parameter index), as in plain DDP.
A parameter must be used by the module that owns it (registered with it): a model that reads
another module's parameter before that module's forward must call `finish()` first.

The bucket backward makes last (the first layers) goes on a priority lane, a second chainermn group
over the same ranks, made by the constructor (so every rank constructs it, in the same order as its
other groups). With `compression`, each lane keeps the residuals of the parameters it carries; a
parameter that changes lanes when DDP rebuilds its buckets (once, after the first step) leaves what
its old lane still owed behind.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations as objects.
import torch
import torch.distributed as dist

from ._backend import get_options
from ._layouts import bucket_layout
from ._means import DdpMean, resolve

__all__ = ["OverlapNextForward"]


class _InFlight:
    """One bucket's mean in flight: the group's Work, the buffer it lands in, its layout (_layouts.py),
    and the hyperparameters its update takes (step() records them)."""

    __slots__ = ("work", "buffer", "layout", "settings")

    def __init__(self, work, buffer, layout):
        self.work = work
        self.buffer = buffer
        self.layout = layout
        self.settings = None  # index of a parameter -> its group's hyperparameters when step() was called


class OverlapNextForward:
    """See the module docstring. `ddp`: a DistributedDataParallel on a chainermn group;
    `optimizer_class` and `kwargs`: the optimizer every parameter gets one of; `compression`: None
    (DDP's float32 mean, exact), or a hooks.GradientCompressionState (its code between nodes, e.g.
    int8, with its error feedback; no longer DDP's bits)."""

    def __init__(self, ddp, optimizer_class, *, compression=None, **kwargs):
        op = "OverlapNextForward"
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            raise ValueError(f"{op}: ddp must be a torch.nn.parallel.DistributedDataParallel, got {type(ddp).__name__}")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise ValueError(f"{op}: optimizer_class must be a torch.optim.Optimizer class, got {optimizer_class!r}")
        self.ddp = ddp
        # None: DDP's own mean, bit for bit; else a compression (its group must be DDP's).
        self.mean, self.process_group = resolve(compression, ddp.process_group, op, plain=DdpMean, dtypes=False)
        self.world_size = self.process_group.size()
        # The priority lane. The bucket backward makes last holds the first layers, which the next forward
        # needs first; it travels on a group of its own (a worker and a queue of its own: chainermn runs a
        # group's ops in issue order), so it does not wait behind the later layers' buckets still in
        # flight, and the next forward starts as soon as it has arrived.
        ranks = dist.get_process_group_ranks(self.process_group)
        self._urgent_group = dist.new_group(ranks, backend="chainermn", pg_options=get_options(self.process_group))
        self._urgent_mean = self.mean.for_group(self._urgent_group)
        self._params = [p for p in ddp.module.parameters() if p.requires_grad]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self.optimizers = [optimizer_class([p], **kwargs) for p in self._params]
        self._pending = {}  # id(param) -> its bucket's _InFlight mean
        self._buffers = {}  # bucket index -> the buffer its means land in (reused every step)
        ddp.register_comm_hook(self, OverlapNextForward._hook)
        self._handles = [
            module.register_forward_pre_hook(self._before_module)
            for module in ddp.module.modules()
            if any(p.requires_grad for p in module.parameters(recurse=False))
        ]

    # ---- the exchange, started in backward --------------------------------------------------------

    @staticmethod
    def _hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Start the bucket's mean on a buffer of its own and hand DDP its bucket back at once: DDP's
        backward ends without waiting, and the mean arrives in the background."""
        grads = bucket.buffer()
        buffer = self._buffers.get(bucket.index())
        if buffer is None or buffer.shape != grads.shape or buffer.dtype != grads.dtype:
            buffer = self._buffers[bucket.index()] = torch.empty_like(grads)
        layout = bucket_layout(bucket)
        urgent = bucket.is_last()  # the first layers: on the priority lane
        if urgent:  # the step's last bucket: the other lane's relayout, if any, is complete too
            work = self._urgent_mean.start_from(grads, buffer, layout, last=True)
            self.mean.end_step()
        else:
            work = self.mean.start_from(grads, buffer, layout, last=False)
        in_flight = _InFlight(work, buffer, layout)
        for param_id, _, _ in layout:
            self._pending[param_id] = in_flight
        done = torch.futures.Future()
        done.set_result(grads)
        return done

    # ---- the update, in the next forward -----------------------------------------------------------

    def _before_module(self, module, args):
        for p in module.parameters(recurse=False):
            in_flight = self._pending.get(id(p))
            if in_flight is not None:
                self._step(in_flight)

    def _step(self, in_flight: _InFlight) -> None:
        """Wait for one bucket's mean (the backend's error, naming the rank, if a peer is lost) and step
        every parameter of it."""
        in_flight.work.wait()
        with torch.no_grad():
            for param_id, offset, numel in in_flight.layout:
                index = self._index[param_id]
                p = self._params[index]
                if self._pending.pop(param_id, None) is None or p.grad is None:
                    continue  # stepped already, or without a gradient in DDP (unused on every rank)
                p.grad.copy_(in_flight.buffer[offset : offset + numel].view_as(p))
                optimizer = self.optimizers[index]
                group = optimizer.param_groups[0]
                now = None
                if in_flight.settings is not None:  # the step's own hyperparameters, then the group's back
                    now = {k: group[k] for k in in_flight.settings[index]}
                    group.update(in_flight.settings[index])
                optimizer.step()
                if now is not None:
                    group.update(now)
                optimizer.zero_grad(set_to_none=True)

    @property
    def param_groups(self) -> list:
        """Every parameter's param group (one a parameter), for a learning-rate schedule to set."""
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def step(self) -> None:
        """Ask for the update of the gradients of the backward just run, with the hyperparameters the
        groups hold now; it is applied module by module in the next forward (or by finish())."""
        settings = {
            index: {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
            for index, optimizer in enumerate(self.optimizers)
        }
        for in_flight in dict.fromkeys(self._pending.values()):
            if in_flight.settings is None:
                in_flight.settings = settings

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: a parameter's gradient is cleared when it is stepped."""

    def finish(self) -> None:
        """Apply every mean still in flight (the last step's, before a checkpoint or at the end)."""
        for in_flight in list(dict.fromkeys(self._pending.values())):
            self._step(in_flight)

    # ---- checkpoints ---------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Every parameter's optimizer state, by parameter index (finish() first: nothing in flight)."""
        self.finish()
        return {"optimizers": [optimizer.state_dict() for optimizer in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        saved = state["optimizers"]
        if len(saved) != len(self.optimizers):
            raise ValueError(
                f"OverlapNextForward.load_state_dict: the state holds {len(saved)} parameters' "
                f"optimizers, this model has {len(self.optimizers)}"
            )
        self.finish()
        for optimizer, one in zip(self.optimizers, saved):
            optimizer.load_state_dict(one)

    def remove(self) -> None:
        """Take the forward pre-hooks off (finish() first)."""
        self.finish()
        for handle in self._handles:
            handle.remove()
