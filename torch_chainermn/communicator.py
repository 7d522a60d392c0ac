"""ChainerMN's communicator object, on a chainermn process group.

    comm = torch_chainermn.create_communicator("hierarchical", allreduce_grad_dtype=torch.float16)
    comm.bcast_data(model)                 # everyone starts from rank 0's parameters
    ...
    loss.backward()
    comm.multi_node_mean_grad(model)       # ChainerMN's allreduce_grad: one packed mean of all gradients

The methods are ChainerMN's (`chainermn.CommunicatorBase`): `send/recv/bcast/gather/allgather/scatter/
alltoall/allreduce` move torch tensors or numpy arrays (and give back the kind they were given, with the
exact dtype and shape), the `_obj` variants move any picklable object. Ranks and sizes are those of the
communicator's own group. Every method is collective over the communicator unless it is point to point,
and every rank must call them in the same order.

How tensors and objects travel between ranks: see messages/ (objects.py, exchange.py).
"""

from __future__ import annotations

import functools
import operator

import numpy as np
import torch
import torch.distributed as dist

from . import _launch
from ._backend import backend_of
from ._means import KeepsMean, WireMean, deprecated_spelling, resolve
from ._layouts import layout_of
from .gradients import mean_coalesced
from .options import Options
from ._topology import topology

from .messages.arrays import (
    array_spec,
    as_plain,
    check_alike,
    describe,
    nbytes,
    plain_array,
    scatter_pieces,
    spec_of,
    torch_dtype_of,
)
from .messages.exchange import exchange
from .messages.framing import (
    DEFAULT_MAX_BUF_LEN,
    TAG_GATHER_OBJ,
    bcast_bytes,
    check_max_buf_len,
    check_rank,
    check_tag,
    chunks,
    wait_all,
)
from .messages.objects import agree, allgather_small, bcast_object, recv_object, send_object

__all__ = ["Communicator", "create_communicator"]


# ---- the communicator -----------------------------------------------------------------------------


class Communicator(KeepsMean):
    """ChainerMN's communicator: a chainermn process group plus ChainerMN's methods on it.

    `Communicator(group)` wraps an existing chainermn group (default: the default group) without
    owning it; `create_communicator` and `split` make communicators that own their group, which
    `finalize()` destroys. Other toolkit functions take a communicator wherever torch takes a group
    (they read its `group`).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, _owns_group: bool = False):
        backend_of(group, "Communicator")  # a chainermn group this rank belongs to, or a clear error
        self.group = group if group is not None else dist.distributed_c10d._get_default_group()
        self._owns_group = _owns_group
        self._finalized = False
        self._rank = dist.get_rank(self.group)
        self._size = dist.get_world_size(self.group)
        self._topology = None
        # How multi_node_mean_grad's mean travels: the group's allreduce_grad_dtype, or compressed between
        # nodes (create_communicator's compression=; _means.py).
        self.mean = WireMean(self.group)

    def __repr__(self):
        return (
            f"Communicator(rank={self.rank}, size={self.size}, communicator_name={self.communicator_name!r}, "
            f"allreduce_grad_dtype={self.allreduce_grad_dtype})"
        )

    # ---- where this rank is
    @property
    def rank(self) -> int:
        """This process's rank in the communicator."""
        return self._rank

    @property
    def size(self) -> int:
        """Number of processes in the communicator."""
        return self._size

    def _topo(self):
        if self._topology is None:  # fixed for the group's life: ask once
            self._topology = topology(self.group)
        return self._topology

    @property
    def intra_rank(self) -> int:
        """Rank among the processes on this node (pick the GPU with it)."""
        return self._topo().intra_rank

    @property
    def intra_size(self) -> int:
        """Number of processes of the communicator on this node."""
        return self._topo().intra_size

    @property
    def inter_rank(self) -> int:
        """Index of this node among the communicator's nodes."""
        return self._topo().inter_rank

    @property
    def inter_size(self) -> int:
        """Number of nodes the communicator spans."""
        return self._topo().inter_size

    @property
    def communicator_name(self) -> str:
        """The allreduce strategy of the group ("hierarchical", "flat", ...)."""
        return backend_of(self.group, "communicator_name").group_options.communicator

    @property
    def allreduce_grad_dtype(self) -> torch.dtype | None:
        """The dtype gradients travel in, or None for their own dtype."""
        return backend_of(self.group, "allreduce_grad_dtype").group_options.allreduce_grad_dtype

    def _options(self) -> Options:
        """Every field of the group's Options, as the group holds them (split's children get them all)."""
        return Options.from_cpp(backend_of(self.group, "split").group_options)

    # ---- arrays, point to point
    def send(self, data, dest: int, tag: int = 0) -> None:
        """Send a tensor or numpy array (or a tuple/list of them) to `dest`; it returns from `recv`.
        Tags are ints below RESERVED_TAG (32000; MPI guarantees 32767, the rest is the toolkit's)."""
        op = "send"
        dest, tag = self._check_peer(op, "dest", dest, tag)
        if isinstance(data, (tuple, list)):
            data = type(data)(plain_array(op, f"data[{i}]", x) for i, x in enumerate(data))
        else:
            data = plain_array(op, "data", data)
        send_object(self.group, data, dest, tag, DEFAULT_MAX_BUF_LEN, op)

    def recv(self, source: int, tag: int = 0):
        """Receive what `source` sent with `send` (shape, dtype and kind travel with the data)."""
        return self._recv("recv", source, tag)

    def _check_peer(self, op: str, name: str, peer: int, tag: int) -> tuple[int, int]:
        """The peer rank and tag of a point-to-point call, checked: the peer must be another rank."""
        peer = check_rank(op, name, peer, self.size)
        tag = check_tag(op, tag)
        if peer == self.rank:
            raise ValueError(f"{op}: {name} must be another rank than this one ({self.rank})")
        return peer, tag

    def _recv(self, op: str, source: int, tag: int):
        """What `source` sent with send or send_obj (the message says which kind it carries)."""
        source, tag = self._check_peer(op, "source", source, tag)
        return recv_object(self.group, source, tag, op)

    # ---- arrays, collectives
    def bcast(self, data, max_buf_len: int | None = None, root: int = 0):
        """Rank `root`'s array, on every rank (others' `data` is ignored and may be None)."""
        op = "bcast"
        root = check_rank(op, "root", root, self.size)
        chunk = check_max_buf_len(op, max_buf_len)
        refusal = None
        if self.rank == root:
            try:
                data = plain_array(op, "data", data)
            except ValueError as error:
                refusal = error
        return bcast_object(self.group, data, root, chunk, op, refusal)

    def gather(self, data, root: int = 0):
        """A tuple of every rank's array (shapes may differ, dtypes may not) on `root`; None elsewhere."""
        op = "gather"
        root = check_rank(op, "root", root, self.size)
        specs = agree(self.group, lambda: array_spec(op, "data", data))
        check_alike(op, specs)
        received = exchange(
            lambda mine, landings: dist.gather(
                mine[0], landings if self.rank == root else None, group=self.group, group_dst=root, async_op=True
            ),
            [plain_array(op, "data", data)],
            specs if self.rank == root else [],
            _widest(specs),
            _device_type(specs[root]),
        )
        return tuple(received) if self.rank == root else None

    def allgather(self, data):
        """A tuple of every rank's array (shapes may differ, dtypes may not), on every rank."""
        op = "allgather"
        specs = agree(self.group, lambda: array_spec(op, "data", data))
        check_alike(op, specs)
        return tuple(
            exchange(
                lambda mine, landings: dist.all_gather(landings, mine[0], group=self.group, async_op=True),
                [plain_array(op, "data", data)],
                specs,
                _widest(specs),
                _device_type(specs[self.rank]),
            )
        )

    def scatter(self, xs, root: int = 0):
        """Rank `root` gives rank i its xs[i] (a sequence of `size` arrays of one dtype, or one array
        with `size` rows); every rank returns its piece. Others' `xs` is ignored."""
        op = "scatter"
        root = check_rank(op, "root", root, self.size)
        pieces, specs, refusal = [], None, None
        if self.rank == root:
            try:
                pieces = [as_plain(p) for p in scatter_pieces(op, xs, self.size)]  # checked there
                specs = [spec_of(p) for p in pieces]
                check_alike(op, specs)
            except ValueError as error:
                refusal = error
        specs = bcast_object(self.group, specs, root, DEFAULT_MAX_BUF_LEN, op, refusal)
        received = exchange(
            lambda sends, mine: dist.scatter(mine[0], sends or None, group=self.group, group_src=root, async_op=True),
            pieces,
            [specs[self.rank]],
            _widest(specs),
        )
        return received[0]

    def alltoall(self, xs):
        """Rank i sends xs[j] to rank j; returns the tuple of what every rank sent to this one."""
        op = "alltoall"

        def describe_xs():
            if not isinstance(xs, (tuple, list)) or len(xs) != self.size:
                raise ValueError(f"{op}: xs must be a tuple or list of {self.size} arrays, got {describe(xs)}")
            return [array_spec(op, f"xs[{i}]", x) for i, x in enumerate(xs)]

        rows = agree(self.group, describe_xs)  # rows[source][dest]
        check_alike(op, [spec for row in rows for spec in row])
        return tuple(
            exchange(
                lambda sends, landings: dist.all_to_all(landings, sends, group=self.group, async_op=True),
                [plain_array(op, "xs", x) for x in xs],
                [rows[source][self.rank] for source in range(self.size)],
                _widest([spec for row in rows for spec in row]),
                _device_type(rows[self.rank][0]),
            )
        )

    def allreduce(self, data):
        """The element-wise sum of every rank's array (same shape and dtype everywhere), as a new
        array on every rank; `data` is left unchanged (ChainerMN's allreduce: SUM only)."""
        op = "allreduce"
        specs = agree(self.group, lambda: array_spec(op, "data", data))
        check_alike(op, specs)
        shapes = {spec[2] for spec in specs}
        if len(shapes) > 1:
            raise ValueError(f"{op}: every rank must pass the same shape, got {sorted(shapes)}")
        torch_dtype_of(op, specs[0])
        array = plain_array(op, "data", data)
        if isinstance(array, torch.Tensor):
            result = array.detach().clone(memory_format=torch.contiguous_format)
            flat = result.reshape(-1)
        else:
            result = np.array(array, order="C", copy=True)
            flat = torch.from_numpy(result.reshape(-1))
        per_chunk = max(1, DEFAULT_MAX_BUF_LEN // max(1, flat.element_size()))
        wait_all(
            [
                dist.all_reduce(flat[b:e], op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                for b, e in chunks(flat.numel(), per_chunk)
            ]
        )
        return result

    # ---- Python objects
    def send_obj(self, obj, dest: int, tag: int = 0) -> None:
        """Send any picklable object to `dest`; it returns from `recv_obj`."""
        op = "send_obj"
        dest, tag = self._check_peer(op, "dest", dest, tag)
        send_object(self.group, obj, dest, tag, DEFAULT_MAX_BUF_LEN, op)

    def recv_obj(self, source: int, tag: int = 0):
        """Receive the object `source` sent with `send_obj` (or `send`)."""
        return self._recv("recv_obj", source, tag)

    def bcast_obj(self, obj, max_buf_len: int | None = None, root: int = 0):
        """Rank `root`'s object, on every rank, sent in chunks of at most `max_buf_len` bytes
        (default 256 MiB), so objects over 2 GiB work."""
        op = "bcast_obj"
        root = check_rank(op, "root", root, self.size)
        chunk = check_max_buf_len(op, max_buf_len)
        return bcast_object(self.group, obj, root, chunk, op)

    def gather_obj(self, obj, root: int = 0, max_buf_len: int | None = None):
        """The list of every rank's object, in rank order, on `root`; None elsewhere."""
        op = "gather_obj"
        root = check_rank(op, "root", root, self.size)
        chunk = check_max_buf_len(op, max_buf_len)
        objs, failures, own_failure = self._gather_to_root(op, obj, root, chunk)
        if own_failure is not None:
            raise own_failure
        if failures:
            raise RuntimeError(f"{op}: " + "; ".join(failures))
        return objs

    def allreduce_obj(self, obj, max_buf_len: int | None = None):
        """The sum (Python `+`, in rank order) of every rank's object, on every rank; identical
        everywhere because the root adds and broadcasts the result."""
        op = "allreduce_obj"
        chunk = check_max_buf_len(op, max_buf_len)
        objs, failures, own_failure = self._gather_to_root(op, obj, 0, chunk)
        total, failure = None, None
        if self.rank == 0:
            if failures:
                failure = RuntimeError("; ".join(failures))
            else:
                try:
                    total = functools.reduce(operator.add, objs)
                except Exception as error:  # noqa: BLE001  every rank must learn of it
                    failure = error
        try:
            total = bcast_object(self.group, total, 0, chunk, op, failure)
        except (ValueError, RuntimeError):
            if own_failure is None:
                raise
        if own_failure is not None:  # this rank's own error says more than the root's report of it
            raise own_failure
        return total

    def _gather_to_root(self, op: str, obj, root: int, chunk: int):
        """On root: (objects in rank order, reasons of the ranks that failed, None). Elsewhere:
        (None, [], this rank's failure to send or None), so that it can still join what follows."""
        if self.rank != root:
            try:
                send_object(self.group, obj, root, TAG_GATHER_OBJ, chunk, op)
            except Exception as error:  # noqa: BLE001  the root was told; raised by the caller
                return None, [], error
            return None, [], None
        objs, failures = [], []
        for source in range(self.size):
            if source == root:
                objs.append(obj)
                continue
            try:
                objs.append(recv_object(self.group, source, TAG_GATHER_OBJ, op))
            except (ValueError, RuntimeError) as error:
                objs.append(None)
                failures.append(str(error))
        return objs, failures, None

    # ---- models
    def bcast_data(self, model: torch.nn.Module) -> None:
        """Make every rank's parameters rank 0's: one packed broadcast per dtype (ChainerMN's
        bcast_data; buffers are not touched, as in ChainerMN)."""
        op = "bcast_data"
        params = [param for _, param in _named_parameters(op, model)]
        groups: dict[tuple, list[torch.Tensor]] = {}
        for param in params:  # first-seen order is the same on every rank: the names are sorted
            groups.setdefault((param.device, param.dtype), []).append(param)
        for tensors in groups.values():
            with torch.no_grad():
                packed = torch._utils._flatten_dense_tensors([t.detach() for t in tensors])
                bcast_bytes(self.group, packed.view(torch.uint8), 0, DEFAULT_MAX_BUF_LEN)
                if self.rank != 0:
                    for tensor, value in zip(tensors, torch._utils._unflatten_dense_tensors(packed, tensors)):
                        tensor.copy_(value)

    def multi_node_mean_grad(self, model: torch.nn.Module, zero_fill: bool = False, async_op: bool = False):
        """Replace every gradient by its mean over the communicator, in one packed call (ChainerMN's
        allreduce_grad / multi_node_mean_grad), travelling in the group's allreduce_grad_dtype, or
        compressed between nodes when the communicator has a compression.

        Parameters are visited in sorted-name order; frozen and lazy (uninitialised) ones are skipped.
        A None gradient is skipped (every rank must agree), or with `zero_fill` replaced by zeros that
        take part, so afterwards it holds the mean. Returns the Work when async_op, else None.
        """
        op = "multi_node_mean_grad"
        params, grads = [], []
        for _, param in _named_parameters(op, model):
            if not param.requires_grad:
                continue
            if param.grad is None:
                if not zero_fill:
                    continue
                param.grad = torch.zeros_like(param)
            params.append(param)
            grads.append(param.grad)
        if not grads:
            return mean_coalesced(grads, group=self.group, async_op=async_op)
        work = self.mean.start(grads, layout_of(grads, params))
        if async_op:
            return work
        work.wait()
        return None

    allreduce_grad = multi_node_mean_grad

    # ---- groups
    def split(self, color, key: int):
        """A new Communicator of the ranks that pass the same `color`, ranked by `key` (ties: by this
        communicator's rank), with this communicator's options; MPI_Comm_split's semantics.

        Collective over this communicator. A rank passing color=None joins no group and gets None.
        """
        op = "split"
        for name, value in (("color", color), ("key", key)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                if not (name == "color" and value is None):
                    raise ValueError(f"{op}: {name} must be an int, got {value!r}")
        everyone = allgather_small(self.group, (None if color is None else int(color), int(key)))
        options = self._options()
        whole_world = self.size == dist.get_world_size()
        mine = None
        for this_color in sorted({c for c, _ in everyone if c is not None}):
            members = sorted((k, rank) for rank, (c, k) in enumerate(everyone) if c == this_color)
            global_ranks = [dist.get_global_rank(self.group, rank) for _, rank in members]
            if whole_world:
                # torch wants every process of the job in new_group, member or not, in the same order.
                group = dist.new_group(global_ranks, backend="chainermn", pg_options=options, sort_ranks=False)
            elif this_color == color:
                # Ranks outside this communicator never get here: synchronise among the members only.
                group = dist.new_group(
                    global_ranks,
                    backend="chainermn",
                    pg_options=options,
                    sort_ranks=False,
                    use_local_synchronization=True,
                )
            else:
                continue
            if this_color == color:
                mine = group
        return None if mine is None else Communicator(mine, _owns_group=True)

    def finalize(self) -> None:
        """Destroy the group this communicator created (a wrapped or default group is left alone).
        Calling it again does nothing."""
        if self._owns_group and not self._finalized:
            dist.destroy_process_group(self.group)
        self._finalized = True

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.finalize()


def _widest(specs) -> int:
    """The bytes every rank moves in an exchange of arrays of these specs: the widest's."""
    return max(nbytes(spec) for spec in specs)


def _device_type(spec) -> str | None:
    """Where received tensors go: the device kind of `spec`'s tensor (None for numpy arrays)."""
    return spec[3] if spec[0] == "torch" else None


def _named_parameters(op: str, model):
    """(name, parameter) in sorted-name order, without lazy (uninitialised) parameters."""
    if not hasattr(model, "named_parameters"):
        raise ValueError(f"{op}: model must be a torch.nn.Module, got {type(model).__name__}")
    return [
        (name, param)
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0])
        if not isinstance(param, torch.nn.parameter.UninitializedParameter)
    ]


def _grad_dtype_option(value):
    """ChainerMN passes numpy dtypes (numpy.float16); Options takes torch dtypes or names."""
    if isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic)):
        return np.dtype(value).name
    return value


def create_communicator(
    communicator_name: str = "hierarchical", allreduce_grad_dtype=None, compression=None, *, gradient_compression=None
) -> Communicator:
    """Create a ChainerMN communicator: a chainermn process group with these options.

    communicator_name: "naive", "flat", "hierarchical", "two_dimensional", "single_node" or "pure_nccl".
    allreduce_grad_dtype: the dtype gradients travel in (torch or numpy dtype, or its name); None keeps
        the gradients' own dtype (unless $CHAINERMN_ALLREDUCE_GRAD_DTYPE says otherwise).
    compression: None, or compression between nodes for multi_node_mean_grad and the multi-node
        optimizer, e.g. {"code": "int8"} or MXNet's {"code": "2bit", "threshold": 0.5}
        (compression.GradientCompression's settings: code, threshold, block, keep, compress_result,
        result_dtype), or a GradientCompression. `gradient_compression=` is its old spelling.

    Without a process group yet, this initialises torch.distributed with the chainermn backend (under
    torchrun or mpiexec; a process started by neither runs as a world of one, as ChainerMN did) and the
    communicator uses the default group. Otherwise it makes a new chainermn group over all ranks,
    collectively (every rank must call it), which `finalize()` destroys.
    """
    op = "create_communicator"
    compression, argument = deprecated_spelling(
        op, "compression", "gradient_compression", compression, gradient_compression
    )
    if not isinstance(communicator_name, str):
        raise ValueError(f"{op}: communicator_name must be a str, got {type(communicator_name).__name__}")
    try:
        options = Options(communicator_name, _grad_dtype_option(allreduce_grad_dtype))
    except ValueError as error:
        raise ValueError(f"{op}: {error}") from None
    if not dist.is_initialized():
        if _launch.record().rendezvous:  # torchrun, mpiexec or srun told us our rank
            dist.init_process_group("chainermn", pg_options=options)
        else:
            dist.init_process_group("chainermn", store=dist.HashStore(), rank=0, world_size=1, pg_options=options)
        comm = Communicator()
    else:
        comm = Communicator(dist.new_group(backend="chainermn", pg_options=options), _owns_group=True)
    try:
        comm.mean, _ = resolve(compression, comm.group, op, argument=argument, dtypes=False)
    except ValueError:
        comm.finalize()
        raise
    return comm
