"""The torch-free generator side of HARTS: what a rollout generator needs, installable alone.

    pip install 'harts[client]'    # numpy, httpx, protobuf: no torch, no FastAPI, no numba

Modules: `client` (the planner's HTTP client), `rollouts` (trajectories and trees -> a batch),
`synthetic` and `workload` (synthetic agentic rollouts), `timing` (clocks shared with the
benchmarks), `engines` (inference engines with per-token log-probs), `tokenizer`, `chat`, `data`,
`tasks` (verifiable multi-turn tasks, plugins, `swe`) and `tree_sampling` (GRPO tree sampling).
The generator side: docs/design/training-loop.md.
"""
