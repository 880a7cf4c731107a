"""A rollout generator for HARTS: multi-turn tool-using episodes -> rollout batches -> the planner.

    harts serve --http-port 8000 --db harts.db &
    python examples/generator_submit.py --url http://127.0.0.1:8000 --steps 4 --world-size 2 --chunk-size 16
    torchrun --nproc_per_node=2 -m trainer.train --config examples/train_tiny_fsdp.toml

Each step samples GROUP episodes per task: the policy answers, calls a tool, reads the tool's
observation and answers again; episodes of one task share the task prompt and branch at every
turn. Rewards become GRPO advantages, the batch goes to the planner as explicit trees (`--form
tree`: the shared prompt, its loss mask and log-probs sent once) or flat trajectories (`--form
flat`) and is planned for the trainer topology at once, with sharing windows (`--no-windows`: the
ablation; `--lockstep`: lock-step phases for trainers that gather parameters per forward and
backward).

What is synthetic here: the policy. `StandInEngine` returns objects shaped like vLLM's
`RequestOutput` (prompt_token_ids, outputs[i].token_ids, outputs[i].logprobs as {token_id:
Logprob}) from a seeded random generator: the token ids, their log-probs, the tool outputs and
the rewards are random numbers, not a model's, so the trainer sees importance ratios far from 1
(clip fraction near 1, large KL) and learns nothing meaningful. The batch format, the planning and
the training are real. For a real policy on a real task use `harts rl` (harts_client.engines,
harts_client.tasks, harts_client.tree_sampling), or replace the engine by
`vllm.LLM(...).generate(prompts, SamplingParams(n=GROUP, logprobs=0))` (or SGLang +
`samples_from_sglang`) and reload weights from the trainer's exports (`latest_export(--exports)`),
whose policy version tags the next batches.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from harts_client.client import PlannerClient  # noqa: E402
from harts_client.rollouts import RolloutBatchBuilder, Trajectory, grpo_advantages, latest_export, samples_from_vllm  # noqa: E402

VOCAB = 256


class StandInEngine:
    """Seeded stand-in for an inference engine: vLLM-shaped outputs with per-token log-probs."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def generate(self, prompt_ids: list[int], n: int, max_tokens: int):
        outputs = []
        for _ in range(n):
            ids = self.rng.integers(0, VOCAB, int(self.rng.integers(max_tokens // 2, max_tokens + 1))).tolist()
            lps = (-self.rng.random(len(ids)) * 3).tolist()
            outputs.append(SimpleNamespace(token_ids=ids, logprobs=[{t: SimpleNamespace(logprob=lp)} for t, lp in zip(ids, lps)]))
        return SimpleNamespace(prompt_token_ids=list(prompt_ids), outputs=outputs)

    def score(self, answer_ids: list[int]) -> float:
        """A stand-in verifier: a reward in [0, 1] for the final answer."""
        return float(np.mean(np.asarray(answer_ids) % 3 == 0))

    def tool(self, call_ids: list[int]) -> list[int]:
        """A tool observation (e.g. a test run's output) for the call the policy made."""
        return self.rng.integers(0, VOCAB, int(self.rng.integers(4, 12))).tolist()


def episode_batch(step: int, *, tasks: int, group: int, engine: StandInEngine, policy_version: int | None,
                  prefix: str = "step-") -> RolloutBatchBuilder:
    """One step's rollouts: per task, `group` two-turn episodes sharing the task prompt."""
    batch = RolloutBatchBuilder(f"{prefix}{step}", vocab_size=VOCAB, policy_version=policy_version)
    for k in range(tasks):
        task = f"step{step}-task{k}"
        prompt = engine.rng.integers(0, VOCAB, 24).tolist()            # system prompt + task statement
        first = samples_from_vllm(engine.generate(prompt, group, 12))   # turn 1: the policy calls a tool
        for j, sample in enumerate(first):
            traj = Trajectory.from_sample(f"{task}/s{j}", sample, group_id=task)
            traj.add_observation(engine.tool(sample.token_ids))        # the tool's output: context, no loss
            (answer,) = samples_from_vllm(engine.generate(traj.tokens, 1, 10))
            traj.add_completion(answer.token_ids, answer.logprobs)     # turn 2: the final answer
            traj.reward = engine.score(answer.token_ids)               # e.g. the fraction of tests passed
            batch.add(traj)
    grpo_advantages(batch.trajectories)
    return batch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=os.environ.get("HARTS_PLANNER_URL", "http://127.0.0.1:8000"))
    p.add_argument("--token", default=os.environ.get("HARTS_TOKEN") or None)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--first-step", type=int, default=0)
    p.add_argument("--batch-prefix", default="step-", help="batch ids are PREFIX<step> (the trainer's job.step_prefix)")
    p.add_argument("--tasks", type=int, default=2)
    p.add_argument("--group", type=int, default=3, help="episodes per task (the GRPO group)")
    p.add_argument("--form", choices=["tree", "flat"], default="tree")
    p.add_argument("--protobuf", action="store_true", help="send protobuf bodies instead of JSON")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--chunk-size", type=int, default=16)
    p.add_argument("--microbatch-tokens", type=int, default=256)
    p.add_argument("--no-windows", action="store_true", help="ablation: duplicate prefixes instead of sharing windows")
    p.add_argument("--lockstep", action="store_true",
                   help="plan lock-step phases (topology lockstep: trainers that gather parameters per forward/backward)")
    p.add_argument("--exports", default=None, help="trainer export root: tag batches with its latest policy_version")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    engine = StandInEngine(args.seed)
    print("generator_submit: stand-in engine: token ids, log-probs, tool outputs and rewards are synthetic (seeded "
          "random); see `harts rl` for a real policy", file=sys.stderr)
    topology = dict(world_size=args.world_size, chunk_size=args.chunk_size, microbatch_tokens=args.microbatch_tokens,
                    no_windows=args.no_windows)
    with PlannerClient(args.url, token=args.token) as client:
        client.wait_ready(60)
        for step in range(args.first_step, args.first_step + args.steps):
            found = latest_export(args.exports) if args.exports else None
            version = found[1] if found else (0 if args.exports else None)
            batch = episode_batch(step, tasks=args.tasks, group=args.group, engine=engine, policy_version=version,
                                  prefix=args.batch_prefix)
            if args.lockstep:  # the topology travels in the plan request's body, which carries every field
                batch.submit(client, form=args.form, protobuf=args.protobuf)
                st = client.plan(batch.batch_id, **topology, lockstep=True)
            else:
                st = batch.submit(client, form=args.form, protobuf=args.protobuf, **topology)["status"]
            print(json.dumps({"step_id": st["step_id"], "state": st["state"], "trajectories": st["trajectories"],
                              "expanded_tokens": st["expanded_tokens"], "unique_tokens": st["unique_tokens"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
