"""Low-communication training: LocalSGD and DiLoCo (with Streaming DiLoCo's fragments), in torchft's shape.

MXNet's `dist_async` let workers go on without waiting for each other every step; its modern form is
to communicate rarely. Each replica takes `sync_every` (H) steps of its own optimizer alone (the inner
steps communicate nothing), then the replicas meet:

- LocalSGD averages the parameters;
- DiLoCo averages the outer gradient, `global - local` (how far each replica moved since the last
  meeting), puts it in the `.grad` of the parameters restored to the last global value, and steps an
  outer optimizer (Nesterov SGD in the paper);
- Streaming DiLoCo syncs the model in F fragments at staggered steps and lets each fragment's exchange
  run in the background for tau inner steps, then merges the new global value into the replica's
  (which went on training meanwhile): `alpha * local + (1 - alpha) * global`;
- eager updates (`eager=True`) let each exchange run during the whole next round: every replica steps
  at once with its own fresh outer gradient standing in for its share of the mean, and corrects it
  when the mean arrives (DiLoCo's docstring, docs/low-communication.md).

    inner = torch.optim.AdamW(model.parameters(), lr=4e-4)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    with torch_chainermn.DiLoCo(model, inner, outer, sync_every=H):
        for x, y in data:
            loss_fn(model(x), y).backward(); inner.step(); inner.zero_grad()

The average is the backend's: `mean_coalesced` (full precision inside a node, the group's strategy
between nodes; float16/bfloat16 on the wire if asked) or, with a GradientCompression, MXNet's 2-bit
or 1-bit codes between nodes with error feedback kept per fragment across syncs. With one replica per
node (the model wrapped in DDP over `node_group()`, DiLoCo over the world) a node's ranks hold the
same outer gradient, the backend sums them in the node and one copy per node crosses the network.

Floating buffers (BatchNorm's statistics) are averaged at every sync (with the first fragment), in
full precision; integer buffers are left alone (every replica counts the same steps).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._backend import backend_of, group_of
from ._layouts import layout_of
from ._means import KeepsMean, compressed, load_state, resolve, saved_state
from .gradients import mean_coalesced
from ._start import STARTS, checksums
from .messages.objects import agree

__all__ = ["DiLoCo", "LocalSGD"]


def _check_count(op: str, name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{op}: {name} must be an int >= {low}, got {value!r}")
    return value


def _trainable(op: str, model) -> list:
    """The model's parameters that train, each once, in model.parameters() order."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"{op}: model must be a torch.nn.Module, got {type(model).__name__}")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{op}: the model has no parameter that requires grad")
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"{op}: the model's parameters must be on one device, found {sorted(map(str, devices))}")
    return params


def _float_buffers(model) -> list:
    return [b for b in model.buffers() if b.is_floating_point()]


def _flat_views(flat: torch.Tensor, tensors) -> list:
    views, offset = [], 0
    for tensor in tensors:
        views.append(flat[offset : offset + tensor.numel()].view(tensor.shape))
        offset += tensor.numel()
    return views


def _flat_like(tensors) -> tuple[torch.Tensor, list]:
    """A flat float buffer (float32, or wider where a tensor is) for `tensors`, and its views."""
    dtype = torch.float32
    for tensor in tensors:
        dtype = torch.promote_types(dtype, tensor.dtype)
    flat = torch.zeros(sum(t.numel() for t in tensors), dtype=dtype, device=tensors[0].device)
    return flat, _flat_views(flat, tensors)


def _split_runs(params: list, fragments: int) -> list:
    """`params` cut into `fragments` contiguous runs of about equal numbers of values, none empty."""
    total = sum(p.numel() for p in params)
    runs, start, seen = [], 0, 0
    for k in range(1, fragments):
        end = start + 1  # at least one parameter in this run
        seen += params[start].numel()
        while end < len(params) - (fragments - k) and seen + params[end].numel() / 2 <= k * total / fragments:
            seen += params[end].numel()
            end += 1
        runs.append(params[start:end])
        start = end
    runs.append(params[start:])
    return runs


class _EveryHSteps:
    """What LocalSGD and DiLoCo share: the inner optimizer's step hook, the step count, the context
    manager, the checks every rank agrees on, and rank 0's start. Each defines `_on_step()`, what
    happens after every inner step."""

    _op = "LocalSGD"

    def __init__(
        self, model, optimizer, sync_every: int, process_group, settings: dict, check=None, start: str = "broadcast"
    ):
        """Check the arguments on every rank at once: a bad argument on any rank (`check` raising
        ValueError), or ranks that differ in settings or in the model's shapes, raise the same
        ValueError on every rank, before any rank waits for a sync that would never come. With
        start="same" the same agreement carries each tensor's checksum (_start.py), and the ranks
        must already hold equal values: nothing is broadcast."""
        op = self._op
        self.process_group = group_of(process_group, op)
        backend_of(self.process_group, op)  # a chainermn group, or a clear error now

        def describe():
            if start not in STARTS:
                raise ValueError(f"{op}: start must be one of {STARTS}, got {start!r}")
            _check_count(op, "sync_every", sync_every, 1)
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise ValueError(f"{op}: the optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
            params = _trainable(op, model)
            if check is not None:
                check(params)
            names = {id(p): name for name, p in model.named_parameters()}
            described = {
                "settings": {**settings, "start": start},
                "params": [(names.get(id(p), "?"), tuple(p.shape), str(p.dtype)) for p in params],
                "buffers": [(tuple(b.shape), str(b.dtype)) for b in _float_buffers(model)],
            }
            if start == "same":
                described["values"] = checksums(model, params, _float_buffers(model))
            return described

        everyone = agree(self.process_group, describe)
        for rank, theirs in enumerate(everyone):
            for field in ("settings", "params", "buffers", "values"):
                if theirs.get(field) != everyone[0].get(field):
                    what = "values (start='same': they must start equal)" if field == "values" else field
                    raise ValueError(
                        f"{op}: ranks disagree on the model's {what}: "
                        f"{_first_difference(everyone[0][field], theirs[field])} "
                        f"on rank 0, {_first_difference(theirs[field], everyone[0][field])} on rank {rank}"
                    )
        self._broadcast_start = start == "broadcast"
        self.sync_every = sync_every
        self.model = model
        # The module that holds the parameters under their own names (a DDP wrapper's is .module).
        self._module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        self.params = _trainable(op, model)
        self.buffers = _float_buffers(model)
        self._optimizer = optimizer
        self._hooks = []
        self.step = 0  # inner steps taken

    def _start_from_first(self, flat: torch.Tensor) -> None:
        """Rank 0's values of the start, unless the ranks proved they hold them already (start="same")."""
        if self._broadcast_start:
            self._broadcast_from_first(flat)

    def _broadcast_from_first(self, flat: torch.Tensor) -> None:
        dist.broadcast(flat, src=dist.get_global_rank(self.process_group, 0), group=self.process_group)

    def __enter__(self):
        self._hooks.append(self._optimizer.register_step_post_hook(self._after_inner_step))
        return self

    def __exit__(self, *exc_info):
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._finish_in_flight()
        return False

    def flush(self) -> None:
        """Wait for every exchange in flight (before a checkpoint, an evaluation, or a clock's stop): its
        mean stays pending and is applied at its step, so nothing the training computes changes."""
        self._finish_in_flight()

    def _after_inner_step(self, optimizer, args, kwargs) -> None:
        self.step += 1
        self._on_step()

    def _finish_in_flight(self) -> None:
        pass


def _first_difference(mine, theirs):
    if isinstance(mine, dict):
        for key in mine:
            if mine.get(key) != (theirs or {}).get(key):
                return f"{key}={mine.get(key)!r}"
        return repr(mine)
    for index, entry in enumerate(mine):
        if index >= len(theirs) or entry != theirs[index]:
            return f"#{index} {entry}"
    return f"{len(mine)} entries"


class LocalSGD(_EveryHSteps):
    """Parameter averaging every `sync_every` steps of `optimizer` (LocalSGD, torchft's shape).

    model: the replica (a module or its DDP wrapper); its trainable parameters and floating buffers
        are averaged over `process_group` (default: the default group; a chainermn group) after every
        sync_every-th `optimizer.step()`, in one packed mean at full precision. With sync_every=1 this
        is DDP's training with the same optimizer (up to the order of the sums).
    start: "broadcast" (default): take rank 0's parameters and buffers (as DDP does when it is built);
        "same": the replicas already hold equal values (the same seed or checkpoint), proved by a
        checksum of every parameter and floating buffer in the construction's agreement (bytes, not
        the model, cross the network); a difference raises on every rank naming the first tensor.
    On construction every rank checks the others train the same shapes with the same settings
    (a clear ValueError on every rank otherwise). Averaging values, not changes, leaves nothing to
    compress: for compressed parameter averaging use DiLoCo with torch.optim.SGD(lr=1) as the outer
    optimizer.
    """

    _op = "LocalSGD"

    def __init__(self, model, optimizer, sync_every: int, process_group=None, *, start: str = "broadcast"):
        super().__init__(model, optimizer, sync_every, process_group, {"sync_every": sync_every}, start=start)
        self._tensors = [p.detach() for p in self.params] + [b for b in self.buffers]
        with torch.no_grad():
            flat, views = _flat_like(self._tensors)
            torch._foreach_copy_(views, self._tensors)
            self._start_from_first(flat)
            torch._foreach_copy_(self._tensors, views)
        self._dtype = flat.dtype

    def _on_step(self) -> None:
        if self.step % self.sync_every == 0:
            self.sync()

    def sync(self) -> None:
        """Average the parameters and floating buffers over the group now (every rank calls it)."""
        mean_coalesced(self._tensors, group=self.process_group, dtype=self._dtype)

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def _check_outer(op: str, outer, params, model) -> None:
    if not isinstance(outer, torch.optim.Optimizer):
        raise ValueError(f"{op}: outer_optimizer must be a torch.optim.Optimizer, got {type(outer).__name__}")
    theirs = {id(p) for group in outer.param_groups for p in group["params"]}
    ours = {id(p) for p in params}
    everything = {id(p) for p in model.parameters()}
    if ours - theirs or theirs - everything:
        raise ValueError(
            f"{op}: outer_optimizer must hold the model's trainable parameters and no others: "
            f"{len(ours - theirs)} of the model's are missing, {len(theirs - everything)} are not "
            f"the model's"
        )


class _Fragment:
    """A contiguous run of the model's parameters that is synced together (Streaming DiLoCo).

    global_flat: the fragment's value at its last sync, the same on every replica (flat).
    outer: the outer gradient `global - local`, flat, then (once `work` is done) its mean.
    local: the replica's own values kept for the merge (only with a fragment delay).
    buffers/buffer_mean: the model's floating buffers and their mean in flight (first fragment only).
    With eager updates (only then): own/own_buffers, what this replica sent at its last sync (its
    outer gradient, its buffers), and scratch/buffer_scratch, where the applied values are formed.
    """

    def __init__(self, index: int, params: list, offset: int, buffers: list, keep_local: bool, eager: bool = False):
        self.index = index
        self.params = params
        self.offset = offset  # the fragment is synced at steps offset, offset + H, offset + 2H, ...
        self.global_flat, self.global_views = _flat_like(params)
        self.outer, self.outer_views = _flat_like(params)
        self.local, self.local_views = _flat_like(params) if keep_local else (None, None)
        self.buffers = buffers
        self.buffer_mean, self.buffer_views = _flat_like(buffers) if buffers else (None, None)
        nothing = (None, None)
        self.own, _ = _flat_like(params) if eager else nothing  # zeros: nothing sent before the first sync
        self.scratch, self.scratch_views = _flat_like(params) if eager else nothing
        self.own_buffers, _ = _flat_like(buffers) if eager and buffers else nothing
        self.buffer_scratch, self.buffer_scratch_views = _flat_like(buffers) if eager and buffers else nothing
        self.layout = layout_of(params, params)  # the compression's residuals follow these parameters
        self.work = None  # the outer gradient's mean in flight
        self.buffer_work = None  # the buffers' mean in flight
        self.apply_at = None  # the inner step at which the mean is applied (None: nothing pending)

    def wait(self) -> None:
        for name in ("work", "buffer_work"):
            work = getattr(self, name)
            if work is not None:
                work.wait()
                setattr(self, name, None)


class DiLoCo(KeepsMean, _EveryHSteps):
    """DiLoCo and Streaming DiLoCo over a chainermn group (see the module docstring).

    model: the replica (a module or its DDP wrapper, e.g. DDP over `node_group()`).
    inner_optimizer: the replica's own optimizer (AdamW in the paper); DiLoCo hooks its step.
    outer_optimizer: an optimizer over the model's trainable parameters, stepped on the averaged
        outer gradient (SGD(lr=0.7, momentum=0.9, nesterov=True) in the paper). With SGD(lr=1)
        and no momentum DiLoCo is LocalSGD.
    sync_every: H, inner steps between two syncs of a fragment.
    process_group: the replicas' group (default: the default group; a chainermn group).
    fragments: F, contiguous runs of model.parameters() of about equal size; fragment i is synced
        at inner steps i*H//F + k*H (k >= 1 for i = 0).
    fragment_delay: tau, inner steps a fragment's exchange runs in the background before its mean is
        applied (0: applied at once; < H / F, so one exchange is in flight at a time).
    fragment_update_alpha: with tau > 0, how much of the replica's own value a fragment keeps when
        the new global value arrives: `alpha * local + (1 - alpha) * global` (Streaming DiLoCo's
        merge; 0.5 by default). With tau = 0 the fragment takes the global value.
    warmup_steps: N, a warm start (as the DiLoCo paper starts from a model trained synchronously): the
        first N inner steps are DDP's (the gradients averaged over the replicas before each, in the
        group's allreduce_grad_dtype: every replica takes the same step), then the fragments' syncs
        begin, at N + i*H//F + k*H. It costs a full gradient exchange a step while it lasts.
    compression: how the outer gradients travel: None (their own dtype, float32), a wire dtype
        (torch.float16, torch.bfloat16), or a GradientCompression or a dict of its settings (the codes
        of torch_chainermn.codes between nodes, full precision inside, error feedback per fragment
        across syncs; a GradientCompression's own group is the one used).

    start: "broadcast" (default): take rank 0's parameters and buffers; "same": the replicas already
        hold equal values (the same seed or checkpoint), proved by checksums: nothing else crosses the
        network before the first step (LocalSGD's `start`).
    eager: eager outer updates (Kale, Douillard et al. 2025, "Eager updates for overlapped
        communication and computation in DiLoCo", arXiv 2502.12996): a fragment's exchange runs in
        the background for a whole round (H inner steps, until the fragment's next sync) and nothing
        waits for it at the sync that starts it. At each sync the replica steps the outer optimizer at
        once on `mean_prev + (fresh - own_prev) / M`: the mean that arrived from the last sync, with
        this replica's own share of it (`own_prev / M`, what it sent then) replaced by its share of the
        outer gradient it has now (`fresh / M`), i.e. the others' last outer gradients and its own
        fresh one, averaged. M is the number of replicas (the group's size, over a DDP replica's ranks).
        The stand-in is corrected at the next sync, when the mean of what it stood for arrives: summed
        over rounds the replica applies every mean, its own share only one round early. Each replica
        keeps its own global value and outer optimizer state (they differ by the share of their own
        outer gradients); no merge (fragment_delay must be 0). Floating buffers take the same rule
        with values: the others' values at the last sync and the replica's own now, averaged. Works
        with `fragments` (each fragment's exchange in flight for H steps), `compression` (its error
        feedback as without eager: the correction removes exactly the stand-in, so what is applied
        over rounds is the sum of the compressed means) and a warm start.

    On construction every rank checks the others train the same shapes with the same settings
    (a clear ValueError on every rank otherwise).
    """

    _op = "DiLoCo"

    def __init__(
        self,
        model,
        inner_optimizer,
        outer_optimizer,
        sync_every: int,
        process_group=None,
        fragments: int = 1,
        fragment_delay: int = 0,
        compression=None,
        fragment_update_alpha: float = 0.5,
        warmup_steps: int = 0,
        *,
        start: str = "broadcast",
        eager: bool = False,
    ):
        op = self._op
        resolved = None
        try:  # the outer gradients' own dtype (float32) unless a wire dtype is given
            resolved = resolve(compression, process_group, op, own_dtype=True)
        except ValueError as error:
            refused = error  # raised in check(), after the ranks agreed: every rank raises it alike
        else:
            mean, process_group = resolved

        def check(params):
            if resolved is None:
                raise refused
            _check_count(op, "warmup_steps", warmup_steps, 0)
            _check_count(op, "fragments", fragments, 1)
            if fragments > len(params):
                raise ValueError(
                    f"{op}: fragments must be at most the number of trainable parameters "
                    f"({len(params)}), got {fragments}"
                )
            _check_count(op, "fragment_delay", fragment_delay, 0)
            if not isinstance(eager, bool):
                raise ValueError(f"{op}: eager must be True or False, got {eager!r}")
            if eager and fragment_delay:
                # The eager exchange is in flight for a whole round already; a delayed mean and its
                # merge on top would be a second, different overlap.
                raise ValueError(
                    f"{op}: eager=True keeps each exchange in flight for a whole round "
                    f"(sync_every steps): fragment_delay must be 0, got {fragment_delay}"
                )
            if isinstance(sync_every, int) and fragment_delay >= sync_every / fragments:
                raise ValueError(
                    f"{op}: fragment_delay must be below sync_every / fragments "
                    f"({sync_every} / {fragments}), got {fragment_delay}"
                )
            if (
                isinstance(fragment_update_alpha, bool)
                or not isinstance(fragment_update_alpha, (int, float))
                or not 0 <= fragment_update_alpha <= 1
            ):
                raise ValueError(
                    f"{op}: fragment_update_alpha must be a number in [0, 1], got {fragment_update_alpha!r}"
                )
            _check_outer(op, outer_optimizer, params, model)

        settings = {
            "sync_every": sync_every,
            "fragments": fragments,
            "fragment_delay": fragment_delay,
            "fragment_update_alpha": fragment_update_alpha,
            # What the value resolved to: the same for {"code": ...} and its old spelling, or a state.
            "compression": repr(mean) if resolved is not None else repr(compression),
            "warmup_steps": warmup_steps,
            "eager": eager,
        }
        super().__init__(model, inner_optimizer, sync_every, process_group, settings, check, start=start)
        self.outer_optimizer = outer_optimizer
        self.fragment_delay = fragment_delay
        self.alpha = float(fragment_update_alpha)
        self.mean = mean  # .compression (KeepsMean): its GradientCompression or None, as on every class
        self.warmup_steps = warmup_steps
        self.eager = eager
        # This replica's share of the group's mean: a DDP replica (one per node) spans its group's ranks.
        ranks = (
            self.model.process_group.size() if isinstance(self.model, torch.nn.parallel.DistributedDataParallel) else 1
        )
        self._share = min(1.0, ranks / self.process_group.size())
        self.fragments = [
            _Fragment(i, run, i * sync_every // fragments, self.buffers if i == 0 else [], fragment_delay > 0, eager)
            for i, run in enumerate(_split_runs(self.params, fragments))
        ]
        if compressed(mean) is not None:  # its checkpoint keyed by the parameters' names, as FSDP2's
            mean.name_parameters(self._module)
        for fragment in self.fragments:  # residuals in fragment order: a checkpoint's fixed structure
            mean.reserve(fragment.layout, fragment.outer.device)
        with torch.no_grad():
            for fragment in self.fragments:  # rank 0's start, and the first global value
                torch._foreach_copy_(fragment.global_views, fragment.params)
                self._start_from_first(fragment.global_flat)
                torch._foreach_copy_(fragment.params, fragment.global_views)
                if fragment.buffers:
                    torch._foreach_copy_(fragment.buffer_views, fragment.buffers)
                    self._start_from_first(fragment.buffer_mean)
                    torch._foreach_copy_(fragment.buffers, fragment.buffer_views)
                    if eager:  # every replica "sent" the start: the mean before the first sync
                        fragment.own_buffers.copy_(fragment.buffer_mean)

    # ---- the warm start ----------------------------------------------------------------------------

    def __enter__(self):
        super().__enter__()
        self._hooks.append(self._optimizer.register_step_pre_hook(self._before_inner_step))
        return self

    @torch.no_grad()
    def _before_inner_step(self, optimizer, args, kwargs) -> None:
        """During the warm start, DDP's training: the gradients' mean over the replicas before every
        inner step (a missing gradient counts as zeros), so every replica takes the same step."""
        if self.step >= self.warmup_steps:
            return
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        mean_coalesced([p.grad for p in self.params], group=self.process_group)

    # ---- the schedule ------------------------------------------------------------------------------

    def _on_step(self) -> None:
        after = self.step - self.warmup_steps  # inner steps since the warm start ended
        if after < 0:
            return
        if after == 0:
            # The replicas are equal (the same steps from the same start): that is the global value.
            with torch.no_grad():
                for fragment in self.fragments:
                    torch._foreach_copy_(fragment.global_views, fragment.params)
                    if self.eager and fragment.buffers:
                        # The replicas' buffers differ (each saw its own batches): their mean is what
                        # the others "sent"; it travels during the first round, as a sync's does.
                        torch._foreach_copy_(fragment.buffer_views, fragment.buffers)
                        fragment.own_buffers.copy_(fragment.buffer_mean)  # before the mean overwrites it
                        self._start_buffer_mean(fragment)
            return
        for fragment in self.fragments:
            if after >= fragment.offset and (after - fragment.offset) % self.sync_every == 0:
                if self.eager:
                    self._eager_sync(fragment)
                else:
                    self._start(fragment)
        for fragment in self.fragments:
            if fragment.apply_at == self.step:
                self._apply(fragment)

    @torch.no_grad()
    def _start(self, fragment: _Fragment) -> None:
        """Start the mean of the fragment's outer gradient (and of the buffers) in the background."""
        if fragment.apply_at is not None:  # cannot happen with tau < H / F; a clear error if it does
            raise RuntimeError(
                f"{self._op}: fragment {fragment.index} is synced again before its last sync was applied"
            )
        torch._foreach_copy_(fragment.outer_views, fragment.params)
        torch.sub(fragment.global_flat, fragment.outer, out=fragment.outer)  # global - local
        fragment.work = self.mean.start([fragment.outer], fragment.layout)
        if fragment.buffers:
            self._start_buffer_mean(fragment)
        fragment.apply_at = self.step + self.fragment_delay

    def _start_buffer_mean(self, fragment: _Fragment) -> None:
        """The mean of the replica's floating buffers now, in flight in fragment.buffer_mean."""
        torch._foreach_copy_(fragment.buffer_views, fragment.buffers)
        fragment.buffer_work = mean_coalesced(
            [fragment.buffer_mean], group=self.process_group, dtype=fragment.buffer_mean.dtype, async_op=True
        )

    @torch.no_grad()
    def _eager_sync(self, fragment: _Fragment) -> None:
        """Eager updates (the class docstring's `eager`): wait for the last sync's mean (in flight
        for a round; zeros before the first sync, when nothing was sent), start this sync's, and step
        the outer optimizer at once on the last mean with this replica's share of it made fresh."""
        fragment.wait()
        fresh, fresh_views = fragment.scratch, fragment.scratch_views
        torch._foreach_copy_(fresh_views, fragment.params)
        torch.sub(fragment.global_flat, fresh, out=fresh)  # global - local: this round's outer gradient
        self._eager_mix(fragment.outer, fragment.own, fresh)
        # The fresh outer gradient goes out; the mixed one, now in the other buffer, is stepped on.
        stepped = fragment.outer_views
        fragment.outer, fragment.outer_views, fragment.scratch, fragment.scratch_views = (
            fresh,
            fresh_views,
            fragment.outer,
            stepped,
        )
        fragment.work = self.mean.start([fragment.outer], fragment.layout)
        if fragment.buffers:
            now, now_views = fragment.buffer_scratch, fragment.buffer_scratch_views
            torch._foreach_copy_(now_views, fragment.buffers)
            self._eager_mix(fragment.buffer_mean, fragment.own_buffers, now)
            mixed = fragment.buffer_views
            fragment.buffer_mean, fragment.buffer_views, fragment.buffer_scratch, fragment.buffer_scratch_views = (
                now,
                now_views,
                fragment.buffer_mean,
                mixed,
            )
            fragment.buffer_work = mean_coalesced(
                [fragment.buffer_mean], group=self.process_group, dtype=fragment.buffer_mean.dtype, async_op=True
            )
            torch._foreach_copy_(fragment.buffers, mixed)
        torch._foreach_copy_(fragment.params, fragment.global_views)
        self._outer_step(fragment, stepped)
        torch._foreach_copy_(fragment.global_views, fragment.params)

    def _eager_mix(self, mean: torch.Tensor, own: torch.Tensor, fresh: torch.Tensor) -> None:
        """mean <- mean + share * (fresh - own), own <- fresh: in the last mean, this replica's share of
        what it sent then replaced by its share of what it has now (`own` is scratch meanwhile)."""
        torch.sub(fresh, own, out=own)
        mean.add_(own, alpha=self._share)
        own.copy_(fresh)

    @torch.no_grad()
    def _apply(self, fragment: _Fragment) -> None:
        """The outer step on the fragment's global value with the averaged outer gradient, then the merge."""
        fragment.wait()
        merge = self.fragment_delay > 0
        if merge:
            torch._foreach_copy_(fragment.local_views, fragment.params)
        torch._foreach_copy_(fragment.params, fragment.global_views)
        self._outer_step(fragment)
        torch._foreach_copy_(fragment.global_views, fragment.params)
        if merge:  # the replica went on for tau steps: keep alpha of its own value
            torch._foreach_lerp_(fragment.params, fragment.local_views, self.alpha)
        if fragment.buffers:
            if merge:
                torch._foreach_lerp_(fragment.buffer_views, fragment.buffers, self.alpha)
            torch._foreach_copy_(fragment.buffers, fragment.buffer_views)
        fragment.apply_at = None

    def _outer_step(self, fragment: _Fragment, grads=None) -> None:
        """Step the outer optimizer on this fragment alone, on `grads` (views; default: the averaged
        outer gradient's): the other parameters' .grad (the inner step's) are set aside meanwhile, so
        the outer optimizer skips them."""
        kept = [(p, p.grad) for group in self.outer_optimizer.param_groups for p in group["params"]]
        for p, _ in kept:
            p.grad = None
        for p, grad in zip(fragment.params, fragment.outer_views if grads is None else grads):
            p.grad = grad if grad.dtype == p.dtype else grad.to(p.dtype)
        try:
            self.outer_optimizer.step()
        finally:
            for p, grad in kept:
                p.grad = grad

    def _finish_in_flight(self) -> None:
        """Leaving the context: no exchange outlives it (its mean stays pending, applied at its step
        if training goes on in the context again)."""
        for fragment in self.fragments:
            fragment.wait()

    # ---- checkpoints -------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The step, each fragment's global value and pending mean, the outer optimizer and the
        compression's residuals (each rank's own, so a resumed run continues bit for bit).

        Every rank calls it (it waits for exchanges in flight; the residuals are gathered). Its
        structure is the same for every DiLoCo of the same model and settings, so a fresh one's
        state_dict() is the template torch.distributed.checkpoint loads into; the outer optimizer's
        state is torch's get_optimizer_state_dict (keyed by parameter names, initialised if empty).
        With eager updates the state is this replica's own (its global value, what it sent at the last
        sync, its outer optimizer): save it per rank, not through DCP as one replicated state.
        """
        # Here, not at import: torch.distributed.checkpoint costs 0.5 s of CPU, and only checkpoints need it.
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        fragments = []
        for fragment in self.fragments:
            fragment.wait()
            fragments.append(
                {
                    "global": fragment.global_flat.clone(),
                    "outer_gradient": fragment.outer.clone(),
                    "buffers": fragment.buffer_mean.clone() if fragment.buffers else torch.zeros(0),
                    "apply_at": -1 if fragment.apply_at is None else fragment.apply_at,
                }
            )
            if self.eager:  # what this replica sent at the last sync: the next sync's correction
                fragments[-1]["own_outer_gradient"] = fragment.own.clone()
                fragments[-1]["own_buffers"] = fragment.own_buffers.clone() if fragment.buffers else torch.zeros(0)
        return {
            "step": self.step,
            "fragments": fragments,
            "outer_optimizer": get_optimizer_state_dict(self._module, self.outer_optimizer),
            "compression": saved_state(self.mean),
        }

    def load_state_dict(self, state: dict) -> None:
        """Take a state_dict() of a DiLoCo of the same model and settings (after constructing this
        one: construction takes rank 0's parameters). Load the model and the inner optimizer too,
        with their own state_dicts, for the run to continue exactly."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict  # as in state_dict()

        op = f"{self._op}.load_state_dict"
        saved = state["fragments"]
        if len(saved) != len(self.fragments):
            raise ValueError(f"{op}: the state has {len(saved)} fragments, this DiLoCo {len(self.fragments)}")
        for fragment, values in zip(self.fragments, saved):
            if values["global"].numel() != fragment.global_flat.numel():
                raise ValueError(
                    f"{op}: fragment {fragment.index} holds {values['global'].numel()} values "
                    f"in the state, {fragment.global_flat.numel()} here"
                )
            if ("own_outer_gradient" in values) != self.eager:
                raise ValueError(
                    f"{op}: the state was saved with eager={not self.eager}, this DiLoCo has eager={self.eager}"
                )
        if (compressed(self.mean) is None) != (state.get("compression") is None):
            load_state(self.mean, state.get("compression"), op)  # raises: saved with another kind of mean
        for fragment, values in zip(self.fragments, saved):
            fragment.wait()
            fragment.global_flat.copy_(values["global"])
            fragment.outer.copy_(values["outer_gradient"])
            if fragment.buffers:
                fragment.buffer_mean.copy_(values["buffers"])
            if self.eager:
                fragment.own.copy_(values["own_outer_gradient"])
                if fragment.buffers:
                    fragment.own_buffers.copy_(values["own_buffers"])
            apply_at = int(values["apply_at"])
            fragment.apply_at = None if apply_at < 0 else apply_at
        set_optimizer_state_dict(self._module, self.outer_optimizer, state["outer_optimizer"])
        load_state(self.mean, state.get("compression"), op)
        self.step = int(state["step"])
