"""The torch-free generator side of HARTS: what a rollout generator needs, installable alone.

    pip install 'harts[client]'    # numpy, httpx, protobuf: no torch, no FastAPI, no numba

Modules: `client` (the planner's HTTP client: submit, plan, poll, retries within a deadline),
`rollouts` (the generator API: trajectories and explicit trees -> a batch, JSON or protobuf, and
the newest weight export), `synthetic` (synthetic agentic rollouts: group, tree and per-call
sampling, used by `harts gen`, the demo and the benchmarks), `timing` (the wall/CPU clocks and
repeat-with-warm-up helpers that `harts calibrate` and the benchmarks share), `engines` (inference
engines with per-token log-probs: transformers, vLLM, SGLang; each imports its framework only when
built), `tokenizer` (the project's byte tokenizer and Hugging Face tokenizer.json), `chat`
(conversations as token ids: plain text or a model's chat template), `data` (task instances from
JSONL or Hugging Face datasets), `tasks` (verifiable multi-turn tasks with tool observations and
rewards, plugins, the `swe` coding environment) and `tree_sampling` (GRPO tree sampling at turn
boundaries, what `harts rl` generates with).
"""
