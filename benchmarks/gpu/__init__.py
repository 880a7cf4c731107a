"""The one-shot GPU benchmark's parts (`python -m benchmarks.bench_gpu`): settings, the section runner
with budgets and result files, the shared context, one module per section, the report."""
