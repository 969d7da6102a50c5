"""Importing mlx-lm without losing the process's open-file limit.

mlx-lm (0.32) calls `resource.setrlimit(RLIMIT_NOFILE, (2048, 4096))` when it is first imported,
to open the many shards of a large model. That also lowers the hard limit, which an unprivileged
process can never raise again: everything started afterwards (a container, a data-loader worker, a
second run in the same process) is held to 4,096 files, and `podman run --ulimit nofile=20000`
fails outright. ptbr imports mlx-lm through `load_mlx_lm()`, which lets the soft limit rise as
mlx-lm wants but keeps the hard limit as it was."""

from __future__ import annotations

import importlib
import sys


def load_mlx_lm():
    """The mlx_lm package, imported once with the hard open-file limit kept (see the module's
    docstring). Raises ImportError as `import mlx_lm` does."""
    if "mlx_lm.utils" in sys.modules:
        return sys.modules["mlx_lm"]
    try:
        import resource
    except ImportError:  # not a POSIX system: mlx-lm does not touch limits there either
        return importlib.import_module("mlx_lm")
    original = resource.setrlimit

    def raise_soft_keep_hard(which, limits):
        if which != resource.RLIMIT_NOFILE:
            return original(which, limits)
        soft, hard = resource.getrlimit(which)
        wanted = limits[0] if hard == resource.RLIM_INFINITY else min(limits[0], hard)
        if soft != resource.RLIM_INFINITY and wanted > soft:
            original(which, (wanted, hard))
        return None

    resource.setrlimit = raise_soft_keep_hard
    try:
        importlib.import_module("mlx_lm.utils")  # the module that sets the limit
    finally:
        resource.setrlimit = original
    return sys.modules["mlx_lm"]
