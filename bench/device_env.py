"""What the device machine needs before the benchmark can run, and what it records about itself: the carried
wheels installed offline (the machine has no registry; bench/README.md), and the environment of a run."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

from bench.report import GIB

ROOT = Path(__file__).resolve().parents[1]

WHEEL_INSTALL = ["-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
                 "--upgrade", "--target"]


class BenchError(RuntimeError):
    """A user mistake (arguments, missing wheels): one line, exit 1."""


# ---------------------------------------------------------------------------- install


def install_wheels(wheels: Path, site: Path) -> list[str]:
    """pip-install the wheels of `wheels` that this Python can install into `site` offline (no index, no
    dependencies); put `site` first on sys.path. Returns the wheel names. Wheels for another Python (a cp311 one
    left from a CPU check) are passed over: pip would refuse the whole call. The device machine has no registry:
    see bench/README.md."""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    here = set(sys_tags())
    every = sorted(Path(wheels).glob("*.whl"))
    found = [p for p in every if here & set(parse_wheel_filename(p.name)[3])]
    if not found:
        raise BenchError(f"--wheels {wheels} holds no .whl file this Python can install (found "
                         f"{[p.name for p in every]}); prepare the folder with the `pip download` command of "
                         "bench/README.md and carry it")
    cmd = [sys.executable, *WHEEL_INSTALL, str(site), *map(str, found)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise BenchError(f"pip could not install {[p.name for p in found]} into {site}: {last[0]}")
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    return [p.name for p in found]


def ensure_packages(wheels: Path, site: Path, module: str = "megatron.core") -> list[str]:
    """Import `module`; if it is missing, install the carried wheels (`install_wheels`) and import again.

    Returns the wheels installed ([] when nothing was needed).
    """
    try:
        importlib.import_module(module)
        return []
    except ImportError:
        pass
    names = install_wheels(wheels, site)
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise BenchError(f"{module} still does not import after installing {names} into {site}: {e}") from None
    return names


def environment(device: str) -> dict:
    import torch

    env = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    for mod in ("transformers", "megatron.core"):
        try:
            env[mod] = importlib.import_module(mod).__version__
        except Exception:  # noqa: BLE001
            env[mod] = None
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_memory_gib=p.total_memory / GIB, sms=p.multi_processor_count,
                   flash_sdp=torch.backends.cuda.flash_sdp_enabled())
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                           timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001
        env["git_commit"] = None
    return env
