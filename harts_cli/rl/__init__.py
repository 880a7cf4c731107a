"""`harts rl`: RL on a verifiable multi-turn task with the planner, the generator and torchrun trainer ranks.

Modules: `run` (the processes and the generator loop, replays of recorded runs), `anchored` (tree
vs expanded on the recorded run's weights), `sinks` (metrics.jsonl, TensorBoard, W&B, the plots).
The config and the warm start, which the RL benchmark uses too, are `trainer.rl`.
"""
