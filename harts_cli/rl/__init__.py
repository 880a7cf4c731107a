"""`harts rl`: RL on a verifiable multi-turn task with the planner, the generator and torchrun trainer ranks.

Modules: `config` (the TOML config and the trainer ranks' config), `warmstart` (supervised warm
start on the task's demonstrations), `run` (the processes and the generator loop, replays of
recorded runs), `sinks` (metrics.jsonl, TensorBoard, W&B, the plots).
"""
