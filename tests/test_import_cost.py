"""`import torch_chainermn` loads what the backend's registration needs, and each feature when it is
first used: a process pays for torch.distributed.checkpoint (0.5 s of CPU) only if it checkpoints DiLoCo,
and 32 ranks on a node do not pay the features they never touch. Checked in fresh interpreters, by
which modules are loaded (the time itself is measured, not asserted: docs/development.md)."""

import json
import os
import subprocess
import sys

# Loaded only by the feature that needs it. The backend, its options and the launcher are not here:
# they are what `import torch_chainermn` is for.
HEAVY = ["torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.tensor"]
FEATURES = [
    "communicator",
    "compression",
    "datasets",
    "extensions",
    "fsdp",
    "functions",
    "hooks",
    "iterators",
    "links",
    "local_sgd",
    "monitoring",
    "nn",
    "optimizers",
    "overlap",
    "torchft",
]


def run(code: str) -> str:
    # TORCH_DEVICE_BACKEND_AUTOLOAD=0: the name "chainermn" must come from `import torch_chainermn`,
    # not from the autoload entry point (torch_chainermn_autoload.py) that `import torch` runs.
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_loads_no_feature_and_every_public_name_resolves_on_first_use():
    code = """
import json, sys, torch_chainermn
print(json.dumps(sorted(sys.modules)))
from torch_chainermn import DiLoCo, hooks
assert "torch.distributed.checkpoint" not in sys.modules  # DiLoCo loads it when it checkpoints
assert hooks.fp16_compress_hook and DiLoCo is torch_chainermn.local_sgd.DiLoCo
for name in torch_chainermn.__all__:  # each imports its module, or raises
    getattr(torch_chainermn, name)
assert set(torch_chainermn.__all__) <= set(dir(torch_chainermn))
try:
    torch_chainermn.no_such_name
except AttributeError as error:
    print(error)
"""
    modules, missing = run(code).splitlines()
    loaded = set(json.loads(modules))
    assert "torch_chainermn._C" in loaded
    early = [
        name
        for name in HEAVY + [f"torch_chainermn.{f}" for f in FEATURES]
        if any(m == name or m.startswith(name + ".") for m in loaded)
    ]
    assert not early, f"loaded by `import torch_chainermn` alone: {early}"
    assert "has no attribute 'no_such_name'" in missing


def test_the_backend_is_registered_by_the_import_alone(tmp_path):
    """init_process_group("chainermn") after `import torch_chainermn` and nothing else (a 1-rank world)."""
    code = f"""
import torch, torch.distributed as dist, torch_chainermn
dist.init_process_group("chainermn", init_method="file://{tmp_path}/store", rank=0, world_size=1)
t = torch.ones(4)
dist.all_reduce(t)
print(dist.get_backend(), t.tolist())
dist.destroy_process_group()
"""
    assert run(code).split() == ["chainermn", "[1.0,", "1.0,", "1.0,", "1.0]"]
