"""What `benchmarks.bench_gpu` runs: named settings as plain functions (full, quick, dry-run).

    s = full()       # the H200 run: qwen3-next-8l-64e in bf16, two `harts gen` workloads, B = 8,192, C = 64
    s = quick()      # the same sections on smaller workloads, one timed step (<= 3 min on an H200)
    s = dry_run()    # the tiny model on the CPU: every section's code path, in about a minute

Section budgets are nominal seconds: the runner gives each section its share of the time left
(`benchmarks.gpu.runner`), so that a slow section leaves less to the later ones, never more
than the total.
"""
from __future__ import annotations

from dataclasses import dataclass, field

#: the sections, in the order they run
SECTIONS = ("env", "throughput", "fidelity", "profile", "peer", "kernels")


@dataclass(slots=True, kw_only=True, frozen=True)
class Workload:
    """One synthetic batch, as `harts gen` makes it (`harts_client.synthetic.generate`)."""

    name: str
    """Name in the results ("tree", "percall")."""
    scheme: str
    """`harts gen --scheme`: "tree" (tree sampling) or "percall" (per-call sampling)."""
    tasks: int
    """`--tasks`: one rollout tree each."""
    seed: int
    """`--seed`."""
    scale: float
    """`--scale`: multiplier of every token length."""
    knobs: dict = field(default_factory=dict)
    """Further `WorkloadConfig` fields (e.g. turns=(4, 6))."""

    def generator_kwargs(self, vocab_size: int) -> dict:
        """Keyword arguments of `harts_client.synthetic.generate`."""
        return dict(scheme=self.scheme, tasks=self.tasks, seed=self.seed, scale=self.scale, vocab_size=vocab_size,
                    **self.knobs)

    def command(self, vocab_size: int) -> str:
        """The `harts gen` command line that writes this batch."""
        extra = "".join(f" --{k.replace('_', '-')} {v[0]}:{v[1]}" if isinstance(v, tuple) else f" --{k.replace('_', '-')} {v}"
                        for k, v in self.knobs.items())
        return (f"harts gen --scheme {self.scheme} --tasks {self.tasks} --seed {self.seed} --scale {self.scale} "
                f"--vocab-size {vocab_size}{extra}")


@dataclass(slots=True, kw_only=True, frozen=True)
class BenchSettings:
    """One configuration of the benchmark."""

    name: str
    """"full", "quick" or "dry-run" (in every result file)."""
    model: str
    """`trainer.models.build_model` name: "qwen3-next-8l-64e" on the GPU, "tiny" in the dry run."""
    device: str
    """"cuda" or "cpu" (the dry run)."""
    dtype: str
    """Parameter and activation dtype of the throughput, profile and peer sections."""
    backend: str
    """Gated delta rule backend of the executor: "triton" on CUDA, "ref" on the CPU."""
    workloads: tuple[Workload, ...]
    """The batches of the throughput section, in order."""
    microbatch_tokens: int = 8192
    """B of every plan (the repacked plan of the fidelity section: B / 2)."""
    chunk_size: int = 64
    """C: the kernel's chunk size."""
    baseline_tokens: int = 32768
    """The expanded plan runs a seeded subset of the batch's trajectories of about this many
    expanded tokens; its rate stands for the batch."""
    fidelity_tokens: int = 16384
    """Subset of the fidelity section's plans (tree, expanded, repacked)."""
    fidelity_workloads: tuple[str, ...] = ("tree",)
    """Workloads of the fidelity section."""
    fidelity_dtypes: tuple[str, ...] = ("bfloat16", "float32")
    """Model dtypes of the fidelity section."""
    profile_tokens: int = 12288
    """Subset of the profiled windows step (a few microbatches: the trace stays small)."""
    peer_workload: str = "tree"
    """Workload whose trajectories the transformers peer runs."""
    peer_tokens: int = 16384
    """Subset of those trajectories the peer runs (its rate stands for the batch)."""
    compiled: bool = True
    """After the throughput rows, time every windows plan again with `ExecutorConfig.compile` (the
    elementwise chains fused by torch.compile; its warm-up step compiles them)."""
    warmup_steps: int = 1
    """Untimed steps per plan before the timed ones (the first compiles)."""
    timed_steps: int = 2
    """Timed steps per plan; rates use the fastest."""
    matmul_size: int = 8192
    """n of the n x n x n torch.mm whose rate is the MFU denominator."""
    lr: float = 1e-5
    """AdamW learning rate of the timed steps."""
    subset_seed: int = 7
    """Seed of every trajectory subset (the same trajectories for ours and the peer)."""
    budgets: dict = field(default_factory=lambda: dict(env=20, throughput=170, fidelity=80, profile=40, peer=70,
                                                       kernels=40))
    """Nominal seconds per section; their sum is the default total budget."""
    kernels_quick: bool = False
    """Run `benchmarks.bench_kernels --gpu --quick` (first shape of each kernel only)."""
    kernels_reps: int = 3
    """`bench_kernels --reps`: timed runs per kernel (after its two warm-ups)."""
    kernels_fla: bool = False
    """Let the kernel report import fla (its first calls autotune for longer than the section's budget)."""

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device: expected 'cuda' or 'cpu', got {self.device!r}")
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dtype: expected 'bfloat16' or 'float32', got {self.dtype!r}")
        c = self.chunk_size
        if c < 1 or c & (c - 1) or self.microbatch_tokens < 2 * c:
            raise ValueError(f"chunk_size/microbatch_tokens: expected a power of two C and B >= 2 C, got C = {c}, "
                             f"B = {self.microbatch_tokens}")
        names = [w.name for w in self.workloads]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"workloads: expected distinct names, got {names}")
        for field_name, wanted in (("fidelity_workloads", self.fidelity_workloads), ("peer_workload", (self.peer_workload,))):
            if unknown := sorted(set(wanted) - set(names)):
                raise ValueError(f"{field_name}: expected names among {names}, got {unknown}")
        if set(self.budgets) != set(SECTIONS) or min(self.budgets.values()) <= 0:
            raise ValueError(f"budgets: expected > 0 seconds for each of {SECTIONS}, got {self.budgets}")
        if self.timed_steps < 1 or self.warmup_steps < 0:
            raise ValueError(f"timed_steps/warmup_steps: expected >= 1 / >= 0, got {self.timed_steps}/{self.warmup_steps}")

    @property
    def total_budget(self) -> float:
        return float(sum(self.budgets.values()))


#: tree sampling and per-call sampling at the scale of the first H200 run (a ~70k- and a ~200k-token batch)
TREE = Workload(name="tree", scheme="tree", tasks=1, seed=0, scale=0.1)
PERCALL = Workload(name="percall", scheme="percall", tasks=1, seed=1, scale=0.05)


def full() -> BenchSettings:
    """The H200 run (<= 7 min with compilation): tree 66,689 expanded / 25,913 distinct tokens,
    percall 242,434 / 14,006."""
    return BenchSettings(name="full", model="qwen3-next-8l-64e", device="cuda", dtype="bfloat16", backend="triton",
                         workloads=(TREE, PERCALL))


def quick() -> BenchSettings:
    """The same sections on smaller batches (tree 22,019 / 15,494, percall 97,035 / 5,629), one
    timed step, the kernel report's first shapes (<= 3 min)."""
    return BenchSettings(
        name="quick", model="qwen3-next-8l-64e", device="cuda", dtype="bfloat16", backend="triton",
        workloads=(Workload(name="tree", scheme="tree", tasks=1, seed=1, scale=0.05),
                   Workload(name="percall", scheme="percall", tasks=1, seed=1, scale=0.02)),
        baseline_tokens=16384, fidelity_tokens=8192, profile_tokens=8192, peer_tokens=8192, timed_steps=1,
        budgets=dict(env=10, throughput=60, fidelity=35, profile=20, peer=35, kernels=20), kernels_quick=True,
        kernels_reps=2)


def dry_run() -> BenchSettings:
    """The tiny model (fp32) on the CPU with small batches (tree 902 expanded tokens, percall
    2,058) and B = 256: several microbatches and windows, every section's code path."""
    few_turns = dict(turns=(4, 6))
    return BenchSettings(
        name="dry-run", model="tiny", device="cpu", dtype="float32", backend="ref",
        workloads=(Workload(name="tree", scheme="tree", tasks=1, seed=1, scale=0.01, knobs=few_turns),
                   Workload(name="percall", scheme="percall", tasks=1, seed=1, scale=0.01, knobs=few_turns)),
        microbatch_tokens=256, baseline_tokens=1024, fidelity_tokens=768, profile_tokens=512, peer_tokens=512,
        timed_steps=1, matmul_size=256,
        budgets=dict(env=30, throughput=120, fidelity=120, profile=60, peer=120, kernels=120), kernels_quick=True,
        kernels_reps=1)


NAMED_SETTINGS = {"full": full, "quick": quick, "dry-run": dry_run}
