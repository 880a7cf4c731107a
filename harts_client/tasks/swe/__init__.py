"""`swe`: an agentic coding environment (SWE-agent-shaped rollouts on generated Python repositories).

    task = make_task("swe", modules=2, functions=3, max_turns=6)       # harts_client.tasks

Modules: `repos` (small repositories with a planted bug and the tests that catch it), `sandbox`
(one tool call in a subprocess: private temporary directory, timeout, CPU / memory / file-size
limits, no network), `_runner` (the sandboxed side, standard library only), `task` (the Task:
prompt, tool calls, reward = the original tests pass).
"""
from harts_client.tasks.swe.task import SWEInstance, SWETask, parse_call

__all__ = ["SWETask", "SWEInstance", "parse_call"]
