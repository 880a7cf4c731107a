"""What `harts rl` and the RL benchmark share: the job's config, its inputs and the supervised warm start.

Modules: `config` (the `harts rl` TOML config and the trainer ranks' config derived from it),
`inputs` (the task, its instances and the conversation format), `warmstart` (supervised warm start
of the policy on a task's demonstrations, in this process, on plans made by a planner the caller
passes in: the trainer never imports the planner). The command itself (processes, the generator
loop, replays, sinks) is `harts_cli.rl` (docs/design/training-loop.md).
"""
