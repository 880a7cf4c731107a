"""The `harts` command line: one entry point composing the planner, the trainer and the tools."""
