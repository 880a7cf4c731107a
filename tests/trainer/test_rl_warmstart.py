"""trainer.rl: what a run reads (task, instances, conversation format) and the warm start on the
demonstrations rendered as the generator renders them, a chat template included."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.modules.setdefault("fla", None)  # transformers must not bind fla's GPU kernels on CPU

from harts_client.chat import ChatTemplateFormat, PlainFormat, load_format  # noqa: E402
from harts_client.data import DatasetInstances, GeneratedInstances  # noqa: E402
from harts_client.tokenizer import ByteTokenizer  # noqa: E402
from tests.harts_client.test_chat import chat_dir  # noqa: E402
from trainer.rl.config import load_rl_config  # noqa: E402
from trainer.rl.inputs import conversation, instance_source, run_task  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _cfg(tmp_path, text: str):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return load_rl_config(path)


def test_conversation_and_instances_of_a_run(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = _cfg(tmp_path, "[task]\nname = 'seek'\n")
    fmt, where = conversation(cfg)
    assert isinstance(fmt, PlainFormat) and isinstance(fmt.tokenizer, ByteTokenizer) and where is None
    assert isinstance(instance_source(cfg, run_task(cfg)[0]), GeneratedInstances)
    (tmp_path / "tok").mkdir()
    chat = chat_dir(tmp_path / "tok")
    cfg = _cfg(tmp_path, f"[task]\nname = 'examples.plugin_task:LookupTask'\n[data]\npath = 'examples/data/lookup.jsonl'\n"
                         f"eval_fraction = 0.25\n[model]\ntokenizer = '{chat}'\n")
    fmt, where = conversation(cfg)
    assert isinstance(fmt, ChatTemplateFormat) and where == chat
    task, reward = run_task(cfg)
    source = instance_source(cfg, task)
    assert isinstance(source, DatasetInstances) and (len(source.train_rows), len(source.eval_rows)) == (60, 20)
    assert reward is None and task.name == "lookup"
    with pytest.raises(ValueError, match="model.tokenizer"):
        conversation(_cfg(tmp_path, f"[model]\ntokenizer = '{tmp_path}'\n"))
    with pytest.raises(ValueError, match="held-out rows"):
        instance_source(_cfg(tmp_path, "[data]\npath = 'examples/data/lookup.jsonl'\neval_fraction = 0.0\n"), task)


@pytest.mark.slow
def test_warm_start_with_a_chat_template_and_sampling_from_its_export(tmp_path, monkeypatch):
    """The demonstrations are rendered by the chat template, the warm start's export carries the
    template, and the transformers engine on it samples trees whose streams are the template's."""
    from harts_cli.rl.run import plan_batch
    from harts_client.engines import make_engine
    from harts_client.tree_sampling import SamplingConfig, sample_batch
    from trainer.rl.warmstart import demonstration_batch, warm_start

    monkeypatch.chdir(ROOT)
    (tmp_path / "tok").mkdir()
    chat = chat_dir(tmp_path / "tok")
    cfg = _cfg(tmp_path, f"[task]\nname = 'examples.plugin_task:LookupTask'\n[data]\npath = 'examples/data/lookup.jsonl'\n"
                         f"[model]\ntokenizer = '{chat}'\n[warmup]\nsteps = 2\nbatch = 4\n")
    task, _ = run_task(cfg)
    fmt, where = conversation(cfg)
    source = instance_source(cfg, task)
    inst = source.train(0, 1, stream=1)[0]
    batch = demonstration_batch(task, fmt, "w", [inst], np.random.default_rng(0), 256).to_json("flat")
    stream = batch["trajectories"][0]["tokens"]
    messages = task.prompt(inst)
    for turn in task.demonstration(inst, None):
        messages.append({"role": "assistant", "content": turn})
        if (obs := task.observe(inst, [m["content"] for m in messages if m["role"] == "assistant"])) is not None:
            messages += obs
    rendered = fmt.hf.encode(fmt.hf.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    assert stream == rendered[: len(stream)] and fmt.hf.decode(rendered[len(stream):]) == "\n"

    warm, history = warm_start(cfg, task, fmt, tmp_path / "warm", plan_batch=plan_batch(cfg), instances=source,
                               tokenizer_dir=where)
    assert len(history) == 2 and np.isfinite(history[-1]["nll"])
    assert json.loads((warm / "tokenizer_config.json").read_text())["chat_template"]
    again = load_format(warm)
    assert isinstance(again, ChatTemplateFormat) and again.prompt_ids(task.prompt(inst)) == fmt.prompt_ids(task.prompt(inst))
    engine = make_engine("transformers", str(warm), device="cpu")
    groups = sample_batch(engine, task, again, source.eval(2), SamplingConfig(branching=[2, 2], max_new_tokens=8), seed=0)
    for g in groups:
        assert g.tree.nodes[0]["tokens"] == again.prompt_ids(task.prompt(g.instance))
        assert all(0.0 <= r <= 1.0 for r in g.rewards) and len(g.episodes) >= 1
