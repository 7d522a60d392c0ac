"""DDP communication hooks: ChainerMN's gradient averaging, FP16/BF16 compression and double buffering.

Every hook has torch's signature `hook(state, bucket) -> Future[Tensor]` and is registered with
`ddp_model.register_comm_hook(state, hook)`. For the stateless hooks the state is a chainermn process
group, or None for the default group, as for torch's own hooks:

    model.register_comm_hook(None, torch_chainermn.hooks.fp16_compress_hook)

    state = torch_chainermn.hooks.DoubleBufferingState(compression=torch.float16)
    model.register_comm_hook(state, torch_chainermn.hooks.double_buffering_hook)
    ...
    state.flush()   # before a checkpoint and at the end of training

    state = torch_chainermn.hooks.GradientCompressionState(code="2bit", threshold=0.5)
    model.register_comm_hook(state, torch_chainermn.hooks.gradient_compression_hook)
    # or double buffered: DoubleBufferingState(compression=GradientCompressionState(...))

The averaging goes through the group's allreduce strategy (Options.communicator). Casting to the wire
dtype and the 1/world_size scaling are fused into the backend's packing pass (`mean_coalesced`), and
16-bit wire dtypes are scaled before the sum so it cannot overflow where the mean fits.
"""

# No `from __future__ import annotations` here: DDP checks the hooks' annotations as objects.
import torch
import torch.distributed as dist

from ._double_buffering import BackgroundMean, start_mean
from ._layouts import bucket_layout, by_parameter, read_into
from ._means import KeepsMean, compressed, deprecated_spelling, resolve
from .compression import DEFAULT_CODE, GradientCompression
from .gradients import mean_coalesced

__all__ = [
    "allreduce_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "DoubleBufferingState",
    "double_buffering_hook",
    "GradientCompressionState",
    "gradient_compression_hook",
]


def _mean_bucket(process_group, bucket: dist.GradBucket, dtype) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket's buffer in place over the group, travelling as `dtype` (None: the group's
    allreduce_grad_dtype, else the bucket's own)."""
    work = mean_coalesced([bucket.buffer()], group=process_group, dtype=dtype, async_op=True)
    # The Work's future holds [buffer]; DDP wants the tensor itself.
    return work.get_future().then(lambda fut: fut.value()[0])


def allreduce_hook(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The mean of the bucket over the group, with the group's strategy and its allreduce_grad_dtype.

    With the default Options this gives the same gradients as DDP without a hook.
    """
    return _mean_bucket(process_group, bucket, None)


def fp16_compress_hook(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """As allreduce_hook, with float16 on the wire: half the bytes of float32 gradients.

    The cast and the 1/world_size prescale happen in the packing pass and the result is cast back
    into the bucket in the unpacking pass; no full-size temporary is made.
    """
    return _mean_bucket(process_group, bucket, torch.float16)


def bf16_compress_hook(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """As fp16_compress_hook, with bfloat16 on the wire (float32's range, fewer mantissa bits)."""
    return _mean_bucket(process_group, bucket, torch.bfloat16)


# DDP refuses any hook *named* bf16_compress_hook unless torch has CUDA and NCCL (a check meant for
# torch's own NCCL hook). This one packs bfloat16 on the CPU too, so it goes by a name of its own.
bf16_compress_hook.__name__ = "chainermn_bf16_compress_hook"


class _Snapshot:
    """One bucket's gradients of one step, averaging in the background, and their layout (_layouts.py),
    so that the mean can still be found parameter by parameter after DDP has regrouped its buckets."""

    __slots__ = ("layout", "mean")

    def __init__(self, layout: tuple, mean: BackgroundMean):
        self.layout = layout
        self.mean = mean


class DoubleBufferingState(KeepsMean):
    """State of `double_buffering_hook` (ChainerMN's double buffering, for DDP).

    At step k each bucket's gradient g_k is copied aside and its allreduce started in the background,
    while the optimizer applies mean(g_{k-1}), whose allreduce ran during step k. Step 1 applies a
    zero gradient (`ready` is False until step 1 ends); every later step is exactly one step stale.
    The communication overlaps the next forward and backward instead of stalling the step.

    process_group: a chainermn group (default: the default group).
    compression: the wire dtype (torch.float16 or torch.bfloat16); None takes the group's
        allreduce_grad_dtype, and when that is None too, the gradients' own dtype. Or a
        GradientCompressionState (or a dict of its settings): the means are compressed between nodes
        (a state's own group is used). `compress=` is its old spelling.
    """

    def __init__(self, process_group=None, compression=None, *, compress=None):
        op = "DoubleBufferingState"
        compression, argument = deprecated_spelling(op, "compression", "compress", compression, compress)
        self.mean, self.process_group = resolve(compression, process_group, op, argument=argument)
        self.world_size = self.process_group.size()
        self.ready = False
        self.steps = 0
        self._previous: dict[int, _Snapshot] = {}  # bucket index -> last step's snapshot
        self._current: dict[int, _Snapshot] = {}  # bucket index -> this step's snapshot
        self._spare: dict[int, torch.Tensor] = {}  # bucket index -> a read mean's buffer, for reuse
        self._by_param = None  # id(param) -> last step's mean of it, after a regrouping

    def flush(self) -> None:
        """Wait for every allreduce in flight (before saving a checkpoint, or at the end of training).

        The gradients stay pending: the next step still applies them, so flushing changes no result.
        """
        for snapshot in (*self._previous.values(), *self._current.values()):
            snapshot.mean.wait()

    # ---- called by the hook ------------------------------------------------------------------------

    def _launch(self, bucket: dist.GradBucket) -> _Snapshot:
        """Copy this step's gradients aside and start their mean in the background."""
        layout = bucket_layout(bucket)
        mean = start_mean(
            [bucket.buffer()],
            self.mean,
            reuse=self._spare.pop(bucket.index(), None),
            params=layout,
            last=bucket.is_last(),
        )
        return _Snapshot(layout, mean)

    def _apply_previous(self, bucket: dist.GradBucket, launched: _Snapshot) -> None:
        """Write mean(g_{k-1}) for this bucket's parameters into the bucket."""
        grads = bucket.buffer()
        previous = self._previous.get(bucket.index())
        if previous is not None and previous.layout == launched.layout:
            previous.mean.read(0, grads)
            self._spare[bucket.index()] = previous.mean.buffer
            return
        if not self._previous:
            grads.zero_()  # step 1: nothing averaged yet
            return
        # DDP regrouped its buckets (it does once, after the first step): gather parameter by parameter.
        if self._by_param is None:
            self._by_param = by_parameter((s.layout, s.mean.wait()) for s in self._previous.values())
        read_into(self._by_param, launched.layout, bucket.gradients())

    def _end_step(self) -> None:
        self._previous, self._current = self._current, {}
        self._by_param = None
        self.ready = True
        self.steps += 1


def double_buffering_hook(state: DoubleBufferingState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Start this step's allreduce in the background and hand DDP the previous step's mean.

    Register with `model.register_comm_hook(DoubleBufferingState(...), double_buffering_hook)`.
    """
    if not isinstance(state, DoubleBufferingState):
        raise ValueError(
            "double_buffering_hook: state must be a torch_chainermn.hooks.DoubleBufferingState, "
            f"got {type(state).__name__}"
        )
    # The snapshot is taken before the bucket is overwritten: with gradient_as_bucket_view the bucket
    # is the parameters' .grad itself.
    launched = state._launch(bucket)
    state._apply_previous(bucket, launched)
    state._current[bucket.index()] = launched
    if bucket.is_last():
        state._end_step()
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


class GradientCompressionState(GradientCompression):
    """State of `gradient_compression_hook`: compression between nodes with error feedback.

    The settings and residuals of compression.GradientCompression (process_group=None, code="2bit",
    threshold=0.5, compress_result=False, result_dtype=torch.float32, block=256, keep=8; or all of them
    as one value, compression=torch_chainermn.CompressionSpec(...)): within a node the gradients are
    summed at full precision, between nodes the code's bits a value travel (any code of
    torch_chainermn.codes.CODES, docs/codes.md: "int8", "4bit" with one scale per `block` values, the
    codes that train with Adam; MXNet's "2bit", "1bit": for SGD; "topk": the `keep` largest of each
    block, DiLoCo's outer gradients), and what was not sent is kept per parameter and sent later. compress_result:
    True compresses the sums on their way back in the same code, "int8" or "4bit" in that code
    (code="4bit", compress_result="int8": 4 bits there, 8 back). Save
    `state.state_dict()` (collective) with a checkpoint and `load_state_dict` it on restart, so
    nothing owed is dropped. `type=` is code's old spelling (deprecated).
    """

    def __init__(
        self,
        process_group=None,
        code: str = DEFAULT_CODE,
        threshold: float = 0.5,
        compress_result: bool | str = False,
        result_dtype: torch.dtype = torch.float32,
        *,
        block: int = 256,
        keep: int = 8,
        compression=None,
        type: str | None = None,  # noqa: A002  (code's old spelling)
    ):
        super().__init__(
            process_group,
            code,
            threshold,
            compress_result,
            result_dtype,
            block=block,
            keep=keep,
            op="GradientCompressionState",
            compression=compression,
            type=type,
        )


def gradient_compression_hook(
    state: GradientCompressionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The bucket's mean over the group, compressed between nodes (see GradientCompressionState).

    Register with `model.register_comm_hook(GradientCompressionState(...), gradient_compression_hook)`.
    """
    if compressed(state) is None:
        raise ValueError(
            "gradient_compression_hook: state must be a torch_chainermn.hooks.GradientCompressionState, "
            f"got {type(state).__name__}"
        )
    work = state.start([bucket.buffer()], bucket_layout(bucket), last=bucket.is_last())
    return work.get_future().then(lambda fut: fut.value()[0])
