"""Registers the "chainermn" torch.distributed backend when torch is imported, without loading it.

torch (2.5+) calls `register()` from its `torch.backends` entry points at `import torch` (unless
TORCH_DEVICE_BACKEND_AUTOLOAD=0). It only records the name with a creator that imports
torch_chainermn (which loads the C++ extension and registers the real creator) the first time a
group is created, so that `dist.init_process_group("chainermn")` works in a process that never
imported torch_chainermn itself (Lightning's spawned workers, a main() that imports late). It never
breaks `import torch`: a failure is a warning.
"""

import warnings

NAME = "chainermn"


def _create(dist_options, pg_options=None):
    import torch_chainermn  # noqa: F401  (registers the real creator, with the extension loaded)
    from torch_chainermn._backend import create_backend

    return create_backend(dist_options, pg_options)


def register() -> None:
    try:
        import torch.distributed as dist

        if not dist.is_available() or hasattr(dist.Backend, NAME.upper()):
            return  # no torch.distributed in this build, or torch_chainermn registered it already
        dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    except Exception as error:  # noqa: BLE001  (import torch must go on whatever happens here)
        warnings.warn(
            f"torch_chainermn: the '{NAME}' backend was not registered at import torch ({error}); "
            "`import torch_chainermn` registers it",
            RuntimeWarning,
            stacklevel=2,
        )
