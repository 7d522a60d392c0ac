"""Gradient compression between nodes, with error feedback: block-quantised int8 and 4-bit, MXNet's 2-bit,
and 1-bit sign with a scale (the codes of torch_chainermn.codes).

Within a node the ranks' gradients are summed at full precision; each node's first rank adds that sum
to its residual and sends 8, 4, 2 or 1 bits per value to the other nodes (the block codes add one
float32 scale per `block` values), keeping what it did not send for the next step, so nothing is
lost, only delayed. The chunk sums come back as float32 (MXNet),
as `result_dtype`, or with `compress_result=True` compressed too (or `compress_result="int8"`: in
that code, e.g. 4 bits there and 8 back), against a second residual. Every
rank gets the sum of what the nodes sent divided by the world size. With one node nothing is
compressed. The codes and the exchange are the backend's (csrc/strategies/compressed.h).

    compression = GradientCompression(code="2bit", threshold=0.5)
    work = compression.start([flat_gradients], params)     # params: the tensors' parameters, in order

The DDP hook (hooks.GradientCompressionState), double buffering, the communicator
(create_communicator(..., compression={...})), the multi-node optimizer, DiLoCo and the overlap all
go through this class (their `compression=` is resolved in _means.py), so the residuals follow
parameters wherever the gradients are laid out: when DDP rebuilds its buckets (after its first step)
they are carried over parameter by parameter (_layouts.py).
"""

from __future__ import annotations

import inspect
import warnings

import torch
import torch.distributed as dist

from . import codes
from ._backend import backend_of, group_of
from ._layouts import by_parameter, layout_of  # noqa: F401  (layout_of: this module's old home of it)
from ._spelling import deprecated_spelling
from .residuals import ResidualStore

__all__ = ["GradientCompression"]


def __getattr__(name: str):
    if name == "TYPES":  # the codes' old name here
        warnings.warn(
            "torch_chainermn.compression.TYPES is deprecated, use torch_chainermn.codes.CODES",
            DeprecationWarning,
            stacklevel=2,
        )
        return codes.CODES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Default(str):
    """`code`'s default: equal to "2bit" wherever it is read, and known (by identity) not to be given,
    so that code= and its old spelling type= given together are refused."""


DEFAULT_CODE = _Default("2bit")


class _Residual:
    """A node leader's residuals for one layout of gradients (empty tensors elsewhere), held in the
    compression's ResidualStore under the layout's key."""

    __slots__ = ("first", "second", "second_offset", "second_count", "params", "work")

    def __init__(self, first, second, second_offset, second_count, params):
        self.first = first
        self.second = second
        self.second_offset = second_offset
        self.second_count = second_count
        self.params = params  # ((id(param), offset, numel), ...) in the flat layout
        self.work = None  # the last mean that updates these residuals (double buffering: in flight)

    def folded(self) -> torch.Tensor:
        """What the node still owes, as one vector over the layout: the second residual's chunk
        added into the first (both are error of the same sum; sending either later delivers it)."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        first = self.first
        if self.second.numel():
            first = first.clone()
            first[self.second_offset : self.second_offset + self.second_count] += self.second[: self.second_count]
        return first


class GradientCompression:
    """Compression settings for a group, and the residuals they keep (see the module docstring).

    process_group: a chainermn group (default: the default group).
    compression: every setting below as one value, a torch_chainermn.CompressionSpec (the settings'
        keywords then stay at their defaults).
    code: "int8" or "4bit" (one scale, the block's largest magnitude over 127 or 7, per `block` values:
        gradients keep their scale, which Adam needs), "topk" (per block the `keep` largest values, int8
        against one scale, with their indices: DiLoCo's outer gradients), "2bit" (MXNet's: +threshold, -threshold or 0 per
        value) or "1bit" (the sign, times the chunk's mean magnitude): any code of
        torch_chainermn.codes.CODES. `type=` is its old spelling (deprecated).
    threshold: 2-bit's threshold, > 0 (MXNet's default 0.5). The other codes do not use it.
    block: values per scale of "int8", "4bit" and "topk" (even for "4bit", at most 65536 for "topk");
        the others do not use it.
    keep: "topk"'s values sent per block (the largest |value|s, 1 <= keep <= block); the others do not
        use it.
    compress_result: compress the chunk sums on their way back too: True (in the same code) or the
        name of a block code, "int8" or "4bit" (with code="4bit", compress_result="int8" sends 4 bits
        a value there and 8 back: the sums, which decide the step, lose less).
    result_dtype: otherwise, the dtype the sums travel back in: torch.float32 (MXNet), float16, bfloat16.
    """

    SETTINGS = ("code", "threshold", "block", "keep", "compress_result", "result_dtype")  # what settings() holds

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
        op: str = "GradientCompression",
        compression: codes.CompressionSpec | None = None,
        type: str | None = None,  # noqa: A002  (code's old spelling)
    ):
        if type is not None:
            # The warning points at the caller, past a subclass's __init__ (hooks.GradientCompressionState).
            frames = 3 + (self.__class__.__init__ is not GradientCompression.__init__)
            code, _ = deprecated_spelling(
                op, "code", "type", None if code is DEFAULT_CODE else code, type, stacklevel=frames
            )
        given = {
            "code": code,
            "threshold": threshold,
            "compress_result": compress_result,
            "result_dtype": result_dtype,
            "block": block,
            "keep": keep,
        }
        if compression is not None:  # the code and its settings as one value
            changed = sorted(name for name, value in given.items() if value != GradientCompression.DEFAULTS[name])
            if not isinstance(compression, codes.CompressionSpec) or changed:
                raise ValueError(
                    f"{op}: compression= takes a torch_chainermn.CompressionSpec, which holds every "
                    f"setting (got {compression!r}" + (f" and {changed}" if changed else "") + ")"
                )
            given = compression.settings()
        # The code and every setting, checked once by the backend (one rule: kernels/codes.h), and
        # passed whole to every mean.
        self.spec = self.check(op, **given)
        self.process_group = group_of(process_group, op)
        self._backend = backend_of(self.process_group, op)
        self.code = str(given["code"])
        self.threshold = float(given["threshold"])
        self.block = given["block"]
        self.keep = given["keep"]
        self.compress_result = given["compress_result"]
        self.result_dtype = given["result_dtype"]
        self._residuals: dict[tuple, _Residual] = {}  # ids of the layout's parameters -> residual
        # The residuals' tensors and their checkpoint's form, shared with FSDP2's (residuals.py).
        self._store = ResidualStore(self._saved_settings())
        self._carried: dict[int, torch.Tensor] | None = None  # id(param) -> residual, while relaid out
        self._index: dict[int, int] = {}  # id(param) -> order of first sight (the state dict's keys)
        self._numel: dict[int, int] = {}  # id(param) -> values
        self._loaded: dict[int, torch.Tensor] = {}  # index -> residual from load_state_dict, not yet placed

    @staticmethod
    def check(
        op: str, *, code: str, threshold: float, compress_result, result_dtype: torch.dtype, block: int, keep: int
    ) -> codes.CompressionSpec:
        """The CompressionSpec of these settings (every one: SETTINGS), or a ValueError naming `op`;
        the rule the constructor applies, for a caller that takes the settings without a group (FSDP2's)."""
        if not isinstance(code, str):
            raise ValueError(f"{op}: code must be one of {codes.CODES}, got {code!r}")
        if not isinstance(result_dtype, torch.dtype):
            raise ValueError(
                f"{op}: result_dtype must be torch.float32, torch.float16 or torch.bfloat16, got {result_dtype!r}"
            )
        return codes.CompressionSpec(
            str(code),
            threshold=threshold,
            block=block,
            keep=keep,
            compress_result=compress_result,
            result_dtype=result_dtype,
            op=op,
            argument="code",
        )

    def __repr__(self):
        return (
            f"GradientCompression(code={self.code!r}, threshold={self.threshold}, block={self.block}, "
            f"keep={self.keep}, compress_result={self.compress_result!r}, result_dtype={self.result_dtype})"
        )

    def settings(self) -> dict:
        return {
            "code": self.code,
            "threshold": self.threshold,
            "block": self.block,
            "keep": self.keep,
            "compress_result": self.compress_result,
            "result_dtype": self.result_dtype,
        }

    @property
    def type(self) -> str:
        """code's old name (deprecated)."""
        warnings.warn(f"{type(self).__name__}.type is deprecated, use .code", DeprecationWarning, stacklevel=2)
        return self.code

    def for_group(self, group) -> "GradientCompression":
        """The same settings on another group of the same ranks, with residuals of its own."""
        return GradientCompression(group, **self.settings())

    def start_from(self, source: torch.Tensor, buffer: torch.Tensor, params, last: bool = True):
        """start() on a copy of `source` in `buffer` (the mean lands there; `source` stays as it is)."""
        buffer.copy_(source)
        return self.start([buffer], params, last)

    def _saved_settings(self) -> dict:
        """settings() as a checkpoint holds them (the dtype by name: loadable without torch's pickler)."""
        return {**self.settings(), "result_dtype": str(self.result_dtype)}

    # ---- the mean ---------------------------------------------------------------------------------

    def start(self, tensors, params, last: bool = True):
        """Start the compressed mean of `tensors` (floating gradients) in place; returns the Work.

        params: (id(param), offset, numel) of each parameter, in the tensors' values laid end to end.
        last: this is the last call of the step: a relayout of the residuals is complete after it.
        """
        if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise ValueError("gradient_compression: tensors must be a non-empty list of torch.Tensor")
        params = tuple(params)
        key = tuple(param_id for param_id, _, _ in params)
        residual = self._residuals.get(key)
        if residual is None:
            residual = self._residual_for(params, sum(t.numel() for t in tensors), tensors[0].device)
            self._residuals[key] = residual
        if last:
            self._carried = None
        residual.work = self._backend.compressed_mean(list(tensors), residual.first, residual.second, self.spec)
        return residual.work

    def end_step(self) -> None:
        """The step's means have all started (as start(..., last=True) says): a relayout of the residuals
        is complete. For a caller whose last mean of the step went elsewhere."""
        self._carried = None

    def reserve(self, params, device) -> None:
        """Make a layout's residuals before its first mean, so that state_dict() holds them from the
        start, in the order reserved (DiLoCo reserves its fragments so: a checkpoint's structure is
        then the same in a fresh run, as torch.distributed.checkpoint needs to load into it)."""
        params = tuple(params)
        key = tuple(param_id for param_id, _, _ in params)
        if key not in self._residuals:
            self._residuals[key] = self._residual_for(params, sum(numel for _, _, numel in params), device)

    def _residual_for(self, params, count: int, device) -> _Residual:
        """A residual for a new layout, holding what earlier layouts (or a loaded state) owe its parameters."""
        # Parameters seen before in another layout: DDP rebuilt its buckets (a first step's buckets,
        # and parameters added later, are new).
        relayout = any(param_id in self._index for param_id, _, _ in params)
        for param_id, _, numel in params:
            if param_id not in self._index:
                self._index[param_id] = len(self._index)
                self._numel[param_id] = numel
        first_n, second_n, second_offset, second_count = self._backend.compression_residuals(count, self.spec)
        if relayout and self._carried is None:
            # Carry every parameter's residual into the new layouts of this step.
            self._carried = by_parameter((old.params, old.folded()) for old in self._residuals.values())
            self._clear()
        key = tuple(param_id for param_id, _, _ in params)
        first, second = self._store.allocate(key, ((first_n,), (second_n,)), device)  # made once, reused
        if first_n:
            for param_id, offset, numel in params:
                owed = (self._carried or {}).get(param_id)
                if owed is None and self.process_group.rank() == 0:
                    owed = self._loaded.get(self._index[param_id])
                if owed is not None:
                    first[offset : offset + numel] = owed.reshape(-1).to(device)
        for param_id, _, _ in params:
            self._loaded.pop(self._index[param_id], None)  # placed (or, off the first rank, owed by it)
        return _Residual(first, second, second_offset, second_count, params)

    def _clear(self) -> None:
        """Drop every layout's residuals (their values carried or loaded elsewhere)."""
        self._residuals.clear()
        self._store.clear()

    # ---- checkpoints (the format: residuals.py, the same as FSDP2's) --------------------------------

    def name_parameters(self, model) -> None:
        """Key state_dict()'s "residuals" by the names of `model`'s parameters (a DDP model: its
        module's) and shape them as the parameters, as torch_chainermn.fsdp.state_dict does; without
        it, by the parameters' order of first sight, flat. DiLoCo names its model's."""
        self._store.name_parameters(model)

    def _key_of(self, param_id: int, index: int):
        named = self._store.name_of(param_id)
        return index if named is None else named[0]

    def state_dict(self, by_rank: bool = False) -> dict:
        """What the nodes still owe, summed over the nodes, per parameter: the same on every rank.

        Collective over the group (every rank calls it). The format is residuals.py's (FSDP2's too):
        "settings", "residuals" keyed by the parameters' names (name_parameters) or else by their
        order of first sight, the same in every run of the same model and buckets. by_rank=True adds
        every rank's own residuals, layout by layout ("by_rank", gathered: the same on every rank),
        so that a run resumed on the same ranks with the same layouts continues bit for bit; the sum
        alone resumes on any ranks, owing the same in all but not split across the nodes as before.
        """
        numel = {index: self._numel[param_id] for param_id, index in self._index.items()}
        for index, values in self._loaded.items():
            numel.setdefault(index, values.numel())
        where, offset = {}, 0
        for index in sorted(numel):
            where[index] = offset
            offset += numel[index]
        owed = torch.zeros(offset, dtype=torch.float32)
        for residual in self._residuals.values():
            values = residual.folded().cpu()
            for param_id, start, count in residual.params:
                if values.numel():
                    owed[where[self._index[param_id]] :][:count] += values[start : start + count]
        if self.process_group.rank() == 0:  # loaded and not placed yet: the first rank owes it
            for index, values in self._loaded.items():
                owed[where[index] :][: values.numel()] += values.reshape(-1).cpu()
        if owed.numel():
            dist.all_reduce(owed, group=self.process_group)
        ids = {index: param_id for param_id, index in self._index.items()}
        residuals = {}
        for index in sorted(numel):
            values = owed[where[index] :][: numel[index]].clone()
            named = self._store.name_of(ids.get(index))
            residuals[index if named is None else named[0]] = values if named is None else values.view(named[1])
        exact = None
        if by_rank:
            mine = []
            for residual in self._residuals.values():
                if residual.work is not None:
                    residual.work.wait()
                    residual.work = None
                mine.append({"first": residual.first.cpu(), "second": residual.second.cpu()})
            everyone = [None] * self.process_group.size()
            dist.all_gather_object(everyone, mine, group=self.process_group)
            exact = {str(layout): [theirs[layout] for theirs in everyone] for layout in range(len(mine))}
        return self._store.state(residuals, exact)

    def load_state_dict(self, state: dict) -> None:
        """Take a state_dict(): the group's first rank owes everything it holds (the sum over the nodes
        is what matters), the other ranks nothing. Residuals held now are dropped. Every rank calls it.
        A state keyed by names needs name_parameters() first (a clear ValueError otherwise)."""
        op = "GradientCompression.load_state_dict"
        self._store.check(state, op)
        exact = state.get("by_rank")
        if isinstance(exact, dict):  # {layout: [every rank's]}; before the one format, [rank][layout]
            exact = [
                [exact[k][rank] for k in sorted(exact, key=int)] for rank in range(len(next(iter(exact.values()), [])))
            ]
        if exact is not None and len(exact) == self.process_group.size() and self._fits(exact):
            # The same ranks and layouts: each rank takes its own residuals back, as they were.
            for residual, saved in zip(self._residuals.values(), exact[self.process_group.rank()]):
                residual.first.copy_(saved["first"])
                residual.second.copy_(saved["second"])
            self._loaded = {}
            return
        loaded = {}
        for key, values in state["residuals"].items():
            if isinstance(key, str) and not key.isdigit():  # a parameter's name
                param_id = self._store.id_of(key)
                if param_id is None:
                    raise ValueError(
                        f"{op}: the state names parameter {key!r}, which this compression does not know "
                        "(name_parameters(model) first, with the model whose parameters these are)"
                    )
                if param_id not in self._index:
                    self._index[param_id] = len(self._index)
                    self._numel[param_id] = values.numel()
                key = self._index[param_id]
            if hasattr(values, "full_tensor"):  # a DTensor: FSDP2's, placed as its parameter (collective)
                values = values.full_tensor()
            loaded[int(key)] = values.detach().reshape(-1).to(torch.float32, copy=True)
        self._clear()
        self._carried = None
        # Every rank keeps the values so that every rank lays out state_dict() alike; only the first
        # rank places them into its residuals (_residual_for).
        self._loaded = loaded

    def _fits(self, by_rank) -> bool:
        """Whether every rank holds layouts of the sizes saved for it (checked on every rank alike,
        from what every rank saved and the sizes this rank's residuals imply for the others)."""
        mine = [(r.first.numel(), r.second.numel()) for r in self._residuals.values()]
        saved = [(s["first"].numel(), s["second"].numel()) for s in by_rank[self.process_group.rank()]]
        fits = torch.tensor([int(mine == saved)], dtype=torch.int32)
        dist.all_reduce(fits, op=dist.ReduceOp.MIN, group=self.process_group)
        return bool(fits.item())


# The constructor's defaults of SETTINGS, read from it (one place says them; the code's as a plain str).
GradientCompression.DEFAULTS = {
    name: str(parameter.default) if isinstance(parameter.default, str) else parameter.default
    for name, parameter in inspect.signature(GradientCompression.__init__).parameters.items()
    if name in GradientCompression.SETTINGS
}
