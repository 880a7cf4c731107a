"""Conversation formats (harts_client.chat): the byte tokenizer keeps its plain format; a model
directory's chat template renders the conversation through transformers' apply_chat_template, and
tree sampling's token streams are that rendering with the sampled ids in place of the assistant
contents, branching at the assistant turns."""
from __future__ import annotations

import json
import sys

import pytest

from harts_client.chat import ChatTemplateFormat, PlainFormat, has_chat_template, load_format
from harts_client.tokenizer import ByteTokenizer

# a ChatML-like template over the byte tokenizer's specials: <|bos|> opens a turn, <|eos|> closes it
TEMPLATE = ("{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")


def chat_dir(tmp_path, template: str = TEMPLATE, as_file: bool = False):
    files = ByteTokenizer().hf_files()
    cfg = json.loads(files["tokenizer_config.json"])
    if as_file:
        (tmp_path / "chat_template.jinja").write_text(template)
    else:
        cfg["chat_template"] = template
    files["tokenizer_config.json"] = json.dumps(cfg)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.fixture(scope="module")
def fmt(tmp_path_factory):
    pytest.importorskip("transformers")
    sys.modules.setdefault("fla", None)
    return ChatTemplateFormat(chat_dir(tmp_path_factory.mktemp("chat")))


def test_plain_format_is_the_byte_tokenizers_own():
    plain = PlainFormat(ByteTokenizer())
    assert plain.prompt_ids("ab\n") == [1, 97, 98, 10] and plain.stop_ids == [2]
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u\n"}]
    assert plain.prompt_ids(msgs) == [1] + list(b"s\nu\n")  # contents joined by newlines, no markup
    assert plain.observation_ids([], [{"role": "tool", "content": "= 3"}], 2) == list(b"= 3\n")
    assert plain.turn_ids("up") == [117, 112, 2]
    with pytest.raises(ValueError, match="message 0"):
        plain.prompt_ids([{"role": "robot", "content": "x"}])


def test_which_directories_have_a_template(tmp_path):
    ByteTokenizer().save(tmp_path / "plain")
    assert not has_chat_template(tmp_path / "plain") and isinstance(load_format(tmp_path / "plain"), PlainFormat)
    for name, as_file in (("config", False), ("jinja", True)):
        (tmp_path / name).mkdir()
        assert has_chat_template(chat_dir(tmp_path / name, as_file=as_file))


def test_chat_template_renders_prompts_and_observations(fmt):
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    want = fmt.hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert want == "<|bos|>system\nsys<|eos|>\n<|bos|>user\nhi<|eos|>\n<|bos|>assistant\n"
    assert fmt.prompt_ids(msgs) == [1] + list(b"system\nsys") + [2, 10, 1] + list(b"user\nhi") + [2, 10, 1] + list(b"assistant\n")
    assert fmt.stop_ids == [2] and fmt.vocab_size == 256
    # after a turn that ended with the sampled <|eos|>: the rest of its closing markup ("\n"), the
    # tool message, the next assistant header
    said = msgs + [{"role": "assistant", "content": "get k1"}]
    obs = fmt.observation_ids(said, "k1 = red", 2)
    assert obs == list(b"\n") + [1] + list(b"tool\nk1 = red") + [2, 10, 1] + list(b"assistant\n")
    assert fmt.prompt_ids("q") == [1] + list(b"user\nq") + [2, 10, 1] + list(b"assistant\n")  # text -> a user message


def test_a_template_that_rewrites_history_is_refused(tmp_path):
    pytest.importorskip("transformers")
    # renders only the last message: a conversation's prefix is not a prefix of its rendering
    bad = ChatTemplateFormat(chat_dir(tmp_path, "{{ messages[-1]['content'] }}<|eos|>"))
    with pytest.raises(ValueError, match="prefix"):
        bad.observation_ids([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "c", 2)


def test_tree_sampling_streams_are_the_template_rendering(fmt):
    """Every trajectory of a chat-template tree is the template's rendering of its conversation,
    with the sampled ids as the assistant contents; the tree branches at the assistant turns."""
    from harts_client.tasks import make_task
    from harts_client.tree_sampling import SamplingConfig, sample_batch
    from tests.harts_client.test_tree_sampling import ScriptedEngine

    task = make_task("examples/plugin_task.py:LookupTask")
    inst = task.from_row({"id": "r", "key": "k1", "table": {"k1": "red"}})
    groups = sample_batch(ScriptedEngine(words=["get k1", "A: red", "nope"]), task, fmt, [inst],
                          SamplingConfig(branching=[3, 2], max_new_tokens=12), seed=1)
    g = groups[0]
    nodes = g.tree.nodes
    assert nodes[0]["tokens"] == fmt.prompt_ids(task.prompt(inst))
    assert 1 < sum(n["parent"] == 0 for n in nodes) <= 3  # the first assistant turn: 3 samples, equal ones merged
    for ep, (_, leaf, _) in zip(g.episodes, g.tree.trajectories):
        stream, k = [], leaf
        while k is not None:  # a node: the sampled turn, then the observation up to the next assistant header
            stream = list(nodes[k]["tokens"]) + stream
            k = nodes[k]["parent"]
        messages = list(task.prompt(inst))
        for turn in ep.turns:
            messages.append({"role": "assistant", "content": turn.text})
            if turn.observation is not None:
                messages += turn.observation
        rendered = fmt.hf.encode(fmt.hf.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
        assert ep.turns[-1].token_ids[-1] == 2  # the last turn ended with its sampled <|eos|>
        assert rendered[: len(stream)] == stream and fmt.hf.decode(rendered[len(stream):]) == "\n"
    assert len(g.episodes) > 1 and len({tuple(ep.turns[0].token_ids) for ep in g.episodes}) > 1
