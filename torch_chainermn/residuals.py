"""The codes' residuals (error feedback): one owner and one checkpoint format, for DDP's side
(compression.GradientCompression: the hooks, the communicator, the optimizer, DiLoCo) and FSDP2's
(fsdp.TwoHopReduceScatter, one store for the modules of a compress_between_nodes call).

A holder is what one mean keeps between steps: a DDP layout of parameters (a node's first rank
holds its "first" and "second" residuals, the other ranks empty tensors), an FSDP2 module's param
group on one rank (["residual"]: N nodes x the rank's shard). The store makes a holder's tensors
once (allocate) and the means reuse them every step.

The checkpoint, the same keys and value kinds on both sides (state_dict() of a GradientCompression
and torch_chainermn.fsdp.state_dict(model)):

    {"settings":  the code's settings, GradientCompression.SETTINGS (the dtype by name),
     "residuals": {parameter: what the nodes still owe it, summed over the nodes, float32},
     "by_rank":   {holder: every rank's own residuals}}

"residuals" is keyed by the parameter's name in its model (FQN) where the store knows it (FSDP2
always; DDP once name_parameters(model) was called, which DiLoCo does), else by its order of first
sight (an int, DDP's older format). A value has the parameter's shape: a DTensor placed as the
parameter is where the parameter is sharded (FSDP2), a plain tensor, the same on every rank, where
it is replicated (DDP; flat where only the index is known). "by_rank" lets a run resumed on the
same ranks continue bit for bit: FSDP2's holders are DTensors sharded by rank (DCP saves and loads
each rank's part in place); DDP's are the list of every rank's {"first", "second"}, gathered.
Loading takes "by_rank" where it fits (the same ranks and holders), else the sums: every node's
debt goes to the first node, which is what matters (the sum over the nodes), on any ranks.
"""

from __future__ import annotations

import torch

__all__ = ["ResidualStore"]

KEYS = ("settings", "residuals", "by_rank")  # a checkpoint's keys, on both sides


class ResidualStore:
    """The residuals of one code's means: holders' tensors, made once, and the checkpoint's form."""

    __slots__ = ("settings", "holders", "_names")

    def __init__(self, settings: dict):
        self.settings = dict(settings)  # as a checkpoint holds them (saved_settings)
        self.holders: dict = {}  # holder key -> its tensors, in order of allocation
        self._names: dict[int, tuple[str, torch.Size]] = {}  # id(param) -> (name, shape)

    @staticmethod
    def saved_settings(settings: dict) -> dict:
        """Settings as a checkpoint holds them: the dtypes by name (loadable without torch's pickler)."""
        return {name: str(value) if isinstance(value, torch.dtype) else value for name, value in settings.items()}

    # ---- the tensors ------------------------------------------------------------------------------

    def allocate(self, holder, shapes, device) -> tuple:
        """Zeros (float32) of `shapes` for `holder`, made once: the same tensors while it holds them."""
        held = self.holders.get(holder)
        if held is None:
            held = self.holders[holder] = tuple(torch.zeros(s, dtype=torch.float32, device=device) for s in shapes)
        return held

    def get(self, holder):
        return self.holders.get(holder)

    def drop(self, holder) -> None:
        self.holders.pop(holder, None)

    def clear(self) -> None:
        self.holders.clear()

    # ---- the parameters' names --------------------------------------------------------------------

    def name_parameters(self, model) -> None:
        """Key the checkpoint's "residuals" by the names of `model`'s parameters (a DDP wrapper's
        module's, so that DDP's and FSDP2's checkpoints of one model have the same keys)."""
        model = getattr(model, "module", model)
        for name, param in model.named_parameters():
            self._names[id(param)] = (name, param.shape)

    def name_of(self, param_id: int):
        """(name, shape) of a named parameter, else None."""
        return self._names.get(param_id)

    def id_of(self, name: str):
        for param_id, (known, _) in self._names.items():
            if known == name:
                return param_id
        return None

    # ---- the checkpoint ---------------------------------------------------------------------------

    def state(self, residuals: dict, by_rank) -> dict:
        """The checkpoint of these sums and holders (by_rank None: without it)."""
        state = {"settings": dict(self.settings), "residuals": residuals}
        if by_rank is not None:
            state["by_rank"] = by_rank
        return state

    def check(self, state: dict, op: str) -> None:
        """A clear ValueError where `state` was saved with other settings."""
        settings = {"keep": 8, **state.get("settings", {})}  # saved before top-k's keep: the default
        if "type" in settings:  # saved before the code's name was "code"
            settings["code"] = settings.pop("type")
        if settings != self.settings:
            raise ValueError(f"{op}: the state was saved with {settings}, this compression has {self.settings}")
