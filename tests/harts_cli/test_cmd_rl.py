"""`harts rl`: the config, the metrics sinks, and (integration) a live run on 2 trainer ranks and its
trajectory-expanded replay: the same loss and grad norm per step."""
from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import types
from pathlib import Path

import pytest

from harts_client.tokenizer import ByteTokenizer
from trainer.config import ConfigError
from trainer.rl.config import load_rl_config
from harts_cli.rl.run import compare_curves, compression_summary, reward_rise, run_rl

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "rl_tiny.toml"

SMALL = """
[run]
steps = 5
nproc = 2
[task]
name = "seek"
[task.options]
size = 6
[warmup]
steps = 30
batch = 16
[sampling]
tasks_per_step = 4
branching = [2, 2]
max_new_tokens = 6
[eval]
every = 2
instances = 8
[trainer.optimizer]
lr = 1e-3
max_grad_norm = 1.0
"""


def test_example_config_loads_and_fills_the_trainer_ranks_config(tmp_path):
    from trainer.config import config_from_dict

    cfg = load_rl_config(EXAMPLE, steps=7, out=str(tmp_path / "x"))
    assert cfg.run.steps == 7 and cfg.run.nproc == 2 and cfg.task.name == "seek" and cfg.trainer["optimizer"]["lr"] == 2e-3
    doc = cfg.trainer_doc(planner_url="http://127.0.0.1:9", model_dir=tmp_path / "w", out=tmp_path)
    t = config_from_dict(doc)
    assert (t.job.steps, t.checkpoint.export_every, t.staleness.max_staleness, t.executor.chunk_size) == (7, 1, 1, 16)
    assert t.checkpoint.export_dtype == "float32" and t.model.name == str(tmp_path / "w")


@pytest.mark.parametrize("text,match", [
    ("[runn]\nsteps = 1\n", "runn: unknown section"),
    ("[run]\nstepz = 1\n", "unknown field run.stepz"),
    ("[run]\nsteps = 0\n", "run.steps: expected >= 1"),
    ("[run]\nsteps = 'x'\n", "run.steps: expected an integer"),
    ("[trainer.job]\nsteps = 3\n", "trainer.job.steps: set by harts rl"),
    ("[trainer.optimizer]\nlr = -1.0\n", "trainer: optimizer.lr: expected > 0"),
    ("[plan]\nform = 'dag'\n", "plan.form"),
    ("[sampling]\nbranching = []\n", None),
], ids=["section", "field", "value", "type", "forced", "trainer", "form", "sampling"])
def test_config_errors_name_the_field(tmp_path, text, match):
    path = tmp_path / "c.toml"
    path.write_text(text)
    if match is None:  # validated when the sampler config is built
        with pytest.raises(ValueError, match="branching"):
            load_rl_config(path).sampling.sampling()
        return
    with pytest.raises(ConfigError, match=match.replace("[", r"\[")):
        load_rl_config(path)


def test_harts_rl_cli_errors_are_one_line(tmp_path):
    bad = tmp_path / "c.toml"
    bad.write_text("[run]\nstepz = 1\n")
    out = subprocess.run([sys.executable, "-m", "harts_cli.main", "rl", "--config", str(bad)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "harts rl: error: " in out.stderr and "unknown field run.stepz" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    out = subprocess.run([sys.executable, "-m", "harts_cli.main", "rl", "--config", str(EXAMPLE), "--replay", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "expected a harts rl run folder" in out.stderr


def test_sinks_write_jsonl_tensorboard_and_wandb(tmp_path, monkeypatch):
    from trainer.rl.config import RLMetricsSection
    from harts_cli.rl.sinks import Sinks, plot_run

    calls = []
    fake = types.ModuleType("wandb")

    class Run:
        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    sinks = Sinks(tmp_path, RLMetricsSection(wandb_project="harts-test", wandb_mode="offline"), config={"run": {"steps": 2}})
    lines = [{"step": 1, "reward_mean": 0.25, "reward_std": 0.1, "compression": 2.0, "step_id": "rl-0"},
             {"step": 2, "reward_mean": 0.5, "reward_std": 0.1, "compression": 2.1, "eval_reward": 1.0}]
    for line in lines:
        sinks.write(line)
    sinks.close()
    assert [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == lines
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())
    assert calls[0][0] == "init" and calls[0][1]["project"] == "harts-test" and calls[0][1]["mode"] == "offline"
    assert calls[1] == ("log", 1, {"reward_mean": 0.25, "reward_std": 0.1, "compression": 2.0}) and calls[-1] == ("finish",)
    assert plot_run(lines, tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ValueError, match="wandb package"):
        Sinks(tmp_path, RLMetricsSection(wandb_project="p"), config={})


def test_reward_rise_and_curve_comparison():
    lines = [{"step": i + 1, "reward_mean": i / 20, "loss": 1.0 + i, "grad_norm": 2.0} for i in range(20)]
    assert reward_rise(lines)["reward_rise"] == pytest.approx(0.5)
    # short runs: the windows shrink to half the steps and never overlap (5 steps: 2 vs 2)
    short = reward_rise(lines[:5])
    assert short["window"] == 2 and short["reward_rise"] == pytest.approx((3.5 - 0.5) / 20)
    assert reward_rise(lines[:1]) == {"window": 0} and reward_rise([]) == {}
    trees = [{"compression": 2.0, "rollout_expanded_tokens": 30, "rollout_unique_tokens": 10},
             {"compression": 4.0, "rollout_expanded_tokens": 10, "rollout_unique_tokens": 10}]
    assert compression_summary(trees) == {"compression_mean": 3.0, "rollout_compression_mean": 2.0}
    other = [dict(ln, loss=ln["loss"] * (1 + 1e-7)) for ln in lines]
    cmp = compare_curves(lines, other)
    assert cmp["steps"] == 20 and cmp["loss_max_rel_diff"] == pytest.approx(1e-7, rel=1e-3) and cmp["grad_norm_max_rel_diff"] == 0


@pytest.mark.parametrize("vocab,tokenizer,match", [
    (320, False, "expected vocab_size 256 for the byte tokenizer"),
    (200, True, "expected a model vocabulary of at least the tokenizer's 256 ids"),
], ids=["byte-tokenizer-vs-320", "tokenizer-vs-200"])
def test_vocabulary_mismatch_is_one_line_before_the_warm_start(tmp_path, vocab, tokenizer, match):
    """A model directory whose vocabulary does not fit the tokenizer stops before any weights are
    built (the defect: vocab 320 ran the warm start, then failed decoding a sampled id >= 256)."""
    from trainer.models import debugmodel

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**debugmodel().to_hf_dict(), "vocab_size": vocab}))
    if tokenizer:
        ByteTokenizer().save(model)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[run]\nsteps = 1\nout = "{tmp_path / "out"}"\n[model]\nname = "{model}"\n')
    with pytest.raises(ValueError, match=match) as err:
        run_rl(load_rl_config(cfg))
    assert "\n" not in str(err.value) and not (tmp_path / "out" / "warmstart").exists()


@pytest.mark.integration
@pytest.mark.slow
def test_live_run_and_its_expanded_replay_give_the_same_curve(tmp_path):
    cfg = tmp_path / "small.toml"
    cfg.write_text(SMALL)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    live = subprocess.run([sys.executable, "-m", "harts_cli.main", "rl", "--config", str(cfg), "--out", str(tmp_path / "live")],
                          cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert live.returncode == 0, live.stderr[-4000:]
    summary = json.loads(live.stdout)
    out = tmp_path / "live"
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [1, 2, 3, 4, 5] and summary["steps"] == 5
    for ln in lines:
        for key in ("reward_mean", "reward_std", "compression", "expanded_tokens_per_s", "loss", "grad_norm",
                    "rollout_trajectories", "sample_policy_version"):
            assert key in ln, key
        assert ln["world_size"] == 2 and ln["compression"] > 1.0
        # staleness bound 1: the batch of trainer step n (trained at version n - 1) was sampled with version
        # n - 2 or newer (the generator waits for it; it never runs ahead of the trainer's exports)
        assert max(0, ln["step"] - 2) <= ln["batch_policy_version"] <= ln["step"] - 1
        assert ln["staleness"] in (0, 1) and not ln["skipped"] and ln["sample_policy_version"] == ln["batch_policy_version"]
        assert ln["reward_mean"] == pytest.approx(ln["rollout_reward_mean"])
    assert any(ln["grad_norm"] > 0 for ln in lines)  # the warm-started policy finds some: rewards differ in groups
    assert {ln["step"] for ln in lines if "eval_reward" in ln} == {2, 4, 5} and "eval_reward_warm_start" in summary
    assert (out / "rl.png").read_bytes()[:4] == b"\x89PNG"
    assert any(p.name.startswith("events.out.tfevents") for p in (out / "tb").iterdir())
    assert sorted(p.name for p in (out / "rollouts").iterdir()) == [f"rl-{i}.json" for i in range(5)]
    export = out / "hf" / (out / "hf" / "latest").read_text().strip()
    assert json.loads((export / "harts.json").read_text())["policy_version"] == 5
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
        assert (export / name).is_file(), name
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in export.iterdir())

    replay = subprocess.run([sys.executable, "-m", "harts_cli.main", "rl", "--config", str(cfg), "--no-sharing",
                             "--replay", str(out), "--out", str(tmp_path / "expanded")],
                            cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert replay.returncode == 0, replay.stderr[-4000:]
    summary = json.loads(replay.stdout)
    expanded = [json.loads(x) for x in (tmp_path / "expanded" / "metrics.jsonl").read_text().splitlines()]
    assert all(ln["compression"] == pytest.approx(1.0) for ln in expanded)
    same, own = summary["same_weights"], summary["comparison"]
    assert same["steps"] == own["steps"] == 5
    # on the recorded run's weights of each step: the 2-rank tree step and the expanded step agree within 1e-6
    assert same["loss_max_rel_diff"] <= 1e-6 and same["grad_norm_max_rel_diff"] <= 1e-6, same
    assert own["loss_max_rel_diff"] <= 1e-5 and own["grad_norm_max_rel_diff"] <= 1e-5, own  # 5 steps of drift
    assert json.loads((tmp_path / "expanded" / "replay.json").read_text())["same_weights"] == same
    assert (tmp_path / "expanded" / "replay.png").is_file()


@pytest.mark.integration
@pytest.mark.slow
def test_the_example_plugin_task_trains_on_its_dataset(tmp_path):
    """examples/rl_plugin.toml: task.name = "examples.plugin_task:LookupTask" on examples/data/lookup.jsonl
    (20% held out), trained by harts rl end to end."""
    out = tmp_path / "plugin"
    run = subprocess.run([sys.executable, "-m", "harts_cli.main", "rl", "--config", str(ROOT / "examples" / "rl_plugin.toml"),
                          "--steps", "2", "--nproc", "1", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                         timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stderr[-4000:]
    summary = json.loads(run.stdout)
    assert summary["steps"] == 2 and "eval_reward_warm_start" in summary and "eval_reward_final" in summary
    assert summary["window"] == 1 and "compression_mean" in summary
    assert "Loading weights" not in run.stderr and "generation flags" not in run.stderr  # quiet without -v
    assert "data: 64 training rows, 16 held out" in run.stderr
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [1, 2] and all(0.0 <= ln["reward_mean"] <= 1.0 for ln in lines)
    batch = json.loads((out / "rollouts" / "rl-0.json").read_text())
    text = ByteTokenizer().decode([t for tree in batch["trees"] for n in tree["nodes"] for t in n["tokens"]])
    # the prompts, and the plugin tool's answers (a value, or its hint after a malformed call) in the trees
    assert len(batch["trees"]) == 32 and re.search(r"What is k\d\?", text)
    assert re.search(r"k\d = [a-z]+|error: say 'get KEY' or 'A: VALUE'", text)
    export = out / "hf" / (out / "hf" / "latest").read_text().strip()
    assert json.loads((export / "config.json").read_text())["eos_token_id"] == 2
