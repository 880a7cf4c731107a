"""Launch configurations of the Triton kernels: tuned over num_stages only, cached on disk.

    @autotune(stages(4, (2, 3)), key=["D"])     # num_warps 4 fixed; num_stages 2 or 3
    @triton.jit(do_not_specialize=["M"])

Candidates may differ in num_stages alone (ValueError otherwise), so whichever wins the bits are
the same; keys never include a row count. HARTS_AUTOTUNE=1 (default on a GPU) benchmarks once and
caches the choice under TRITON_CACHE_DIR; 0 or the interpreter runs the first candidate
(docs/design/numerics.md, "Determinism").
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
from contextlib import contextmanager
from pathlib import Path

import triton

__all__ = ["INTERPRET", "TUNE", "JsonTuningCache", "autotune", "candidates", "pinned", "stages"]

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TUNE = not INTERPRET and os.environ.get("HARTS_AUTOTUNE", "1") != "0"
#: Whether this Triton's `autotune` caches its choices on disk itself.
TRITON_DISK_CACHE = "cache_results" in inspect.signature(triton.autotune).parameters


def stages(num_warps: int, num_stages: tuple[int, ...], **meta) -> list[triton.Config]:
    """Candidates with fixed numerics (num_warps, meta-parameters) over num_stages (first: num_stages[0])."""
    return [triton.Config(dict(meta), num_warps=num_warps, num_stages=s) for s in num_stages]


def _numerics(config: triton.Config) -> tuple:
    """What of a config can change a kernel's bits: everything but num_stages."""
    return (sorted(config.kwargs.items()), config.num_warps, getattr(config, "num_ctas", 1),
            getattr(config, "maxnreg", None))


def autotune(configs: list[triton.Config], key: list[str]):
    """`triton.autotune` over `configs` (which must differ in num_stages only), choices cached on
    disk; under the interpreter or HARTS_AUTOTUNE=0, the first config only. The full candidate
    list stays on the returned autotuner (`candidates`)."""
    if len({repr(_numerics(c)) for c in configs}) != 1:
        raise ValueError(
            "configs: expected candidates that differ in num_stages only (num_warps and meta-parameters change "
            f"a kernel's bits; kernels/triton_tuning.py), got {[str(c) for c in configs]}"
        )
    used = configs if TUNE else configs[:1]
    kwargs = {"cache_results": True} if TRITON_DISK_CACHE and len(used) > 1 else {}

    def decorate(fn):
        tuner = triton.autotune(configs=used, key=key, **kwargs)(fn)
        tuner.harts_candidates = list(configs)
        if len(used) > 1 and not TRITON_DISK_CACHE:
            JsonTuningCache(tuner).install()
        return tuner

    return decorate


def _tuner(kernel):
    """The autotuner made by `autotune` inside `kernel` (which may be wrapped in heuristics)."""
    while not hasattr(kernel, "harts_candidates"):
        kernel = kernel.fn
    return kernel


def candidates(kernel) -> list[triton.Config]:
    """Every candidate config of a kernel made by `autotune` (also those HARTS_AUTOTUNE=0 skips)."""
    return list(_tuner(kernel).harts_candidates)


@contextmanager
def pinned(pins: dict):
    """Run kernels made by `autotune` with the given configs: `{kernel: config}` (for tests and
    benchmarks that compare configs); their tuning state is restored afterwards."""
    pins = {_tuner(k): config for k, config in pins.items()}
    saved = {k: (k.configs, dict(k.cache)) for k in pins}
    try:
        for k, config in pins.items():
            k.configs, k.cache = [config], {}
        yield
    finally:
        for k, (configs, cache) in saved.items():
            k.configs, k.cache = configs, cache


def _cache_dir() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache") / "harts-autotune"


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


class JsonTuningCache:
    """Tuned choices of one autotuner on disk, for Tritons whose `autotune` has no `cache_results`.

    The file `<TRITON_CACHE_DIR>/harts-autotune/<kernel>-<digest>.json` maps each tuning key (the
    autotuner's: key argument values and argument dtypes) to the chosen config; the digest covers
    the kernel's source, the device name, the Triton version and the candidates, so a change of
    any of them starts a new file. Loaded into the autotuner's in-memory cache on its first launch;
    rewritten (atomically) when a launch tuned a new key.
    """

    def __init__(self, tuner, *, device_name: str | None = None):
        self.tuner = tuner
        fn = tuner.fn
        while not hasattr(fn, "cache_key"):
            fn = fn.fn
        digest = hashlib.sha256("\n".join([
            fn.cache_key, device_name or _device_name(), triton.__version__, *map(str, tuner.configs),
        ]).encode()).hexdigest()[:16]
        self.path = _cache_dir() / f"{fn.__name__}-{digest}.json"
        self.loaded = False

    def load(self) -> None:
        """Add the file's choices to the autotuner's in-memory cache (once)."""
        self.loaded = True
        try:
            entries = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        for key, c in entries:
            self.tuner.cache.setdefault(
                tuple(key), triton.Config(c["kwargs"], num_warps=c["num_warps"], num_stages=c["num_stages"]))

    def save(self) -> None:
        """Write every in-memory choice of the autotuner (temporary file, then rename)."""
        entries = [[list(key), {"kwargs": c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}]
                   for key, c in self.tuner.cache.items()]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries))
        os.replace(tmp, self.path)

    def install(self) -> None:
        """Route the autotuner's launches through the cache."""
        run = self.tuner.run

        def cached_run(*args, **kwargs):
            if not self.loaded:
                self.load()
            known = len(self.tuner.cache)
            out = run(*args, **kwargs)
            if len(self.tuner.cache) > known:
                self.save()
            return out

        self.tuner.run = cached_run
