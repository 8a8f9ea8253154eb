"""data.source chat: rendering (equal to transformers), assistant loss masks, packing, hostile rows, checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from chat_fixtures import CHATML, STRICT, TALK, expected_mask, jsonl, template_file, tokenizer_dir
from trainer.data.chat.pack import IGNORE, open_chat, pack
from trainer.data.chat.rows import read_conversations
from trainer.data.chat.spans import ChatEncoder
from trainer.data.chat.template import compile_template
from trainer.data.checks import check_data
from trainer.data.hf_dir import tokenizer_json
from trainer.data.tokens import DataError
from trainer.manifest.schema import DataSection


def section(path: Path, **kw) -> DataSection:
    return DataSection(source="chat", path=str(path), **kw)


@pytest.mark.parametrize("template, bos", [(CHATML, None), (STRICT, "<|endoftext|>")])
def test_ids_equal_transformers_apply_chat_template(tmp_path, template, bos):
    transformers = pytest.importorskip("transformers")
    d = tokenizer_dir(tmp_path / "tok", template=template, bos=bos)
    stream = open_chat(section(jsonl(tmp_path / "c.jsonl", TALK[:2]), tokenizer=str(d)), seq_len=255, vocab=300)
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    for conv in range(2):
        ref = tok.apply_chat_template(TALK[conv], tokenize=True)
        ref = ref["input_ids"] if hasattr(ref, "keys") else ref
        assert stream.ids[0][stream.docs[0] == conv].tolist() == list(ref) and len(ref) > 5
    assert (stream.ids[0][0] == tok.convert_tokens_to_ids("<|endoftext|>")) == (bos is not None)  # bos_token reached


def test_a_template_that_raises_names_the_row(tmp_path):
    d = tokenizer_dir(tmp_path / "tok", template=STRICT)
    path = jsonl(tmp_path / "c.jsonl", [TALK[1], [{"role": "tool", "content": "x"}]])
    with pytest.raises(DataError, match=rf"^{path}:2: the chat template fails \(TemplateError: unknown role tool\)"):
        open_chat(section(path, tokenizer=str(d)), seq_len=64, vocab=300)


def test_assistant_mask_equals_a_hand_built_one_and_all_means_all():
    render = compile_template(CHATML, {})
    for talk in TALK:
        ids, loss = ChatEncoder(render, "byte")(talk, "t")
        text = bytes(ids.astype(np.uint8)).decode()
        assert np.array_equal(loss, expected_mask(text, talk))
    ids, loss = ChatEncoder(render, "byte", loss_on="all")(TALK[0], "t")
    assert loss.all() and ids.size == len(render(TALK[0]).encode())


def test_bpe_mask_covers_the_assistant_text(tmp_path):
    from trainer.data.tokens import hf_tokenizer

    tok = hf_tokenizer(tokenizer_dir(tmp_path / "tok"))
    ids, loss = ChatEncoder(compile_template(CHATML, {}), tok)(TALK[0], "t")
    assert tok.decode(ids[loss].tolist(), skip_special_tokens=False) == \
        "fine thanks<|im_end|>\nthe weather is nice, é<|im_end|>\n"


def test_packing_keeps_conversations_whole_and_counts_each_once():
    a = (np.arange(6) + 1, np.ones(6, dtype=bool))
    b = (np.arange(5) + 1, np.zeros(5, dtype=bool))
    c = (np.arange(30), np.ones(30, dtype=bool))
    ids, loss, docs, truncated = pack([a, b, c], seq_len=9)  # windows of 10: [a(6)] [b(5)] [c cut to 10]
    assert ids.shape == (3, 10) and truncated == 1
    assert docs[0].tolist() == [0] * 6 + [-1] * 4 and docs[1].tolist() == [1] * 5 + [-1] * 5
    assert (docs[2] == 2).all() and loss[0, 6:].sum() == 0 and not loss[1].any() and ids[2].tolist() == list(range(10))
    ids, loss, docs, truncated = pack([(a[0][:3], a[1][:3]), b], seq_len=9)  # 3 + 5 fit in one window
    assert ids.shape == (1, 10) and docs[0].tolist() == [0] * 3 + [1] * 5 + [-1] * 2 and truncated == 0


def test_a_conversation_without_assistant_turn_carries_no_loss_and_is_counted(tmp_path):
    stream = open_chat(section(jsonl(tmp_path / "c.jsonl", [TALK[2]]), chat_template=str(template_file(tmp_path / "t.jinja"))),
                       seq_len=64, vocab=256)
    assert stream.conversations == 1 and stream.ids.shape == (1, 65) and (stream.docs[0] == 0).sum() > 10
    assert stream.loss_tokens.tolist() == [0] and (stream.labels(0) == IGNORE).all()


@pytest.mark.parametrize("row, message", [
    ('{"messages": "hi"}', "a row needs \"messages\""),
    ('{"messages": []}', "0 messages"),
    ('{"messages": [{"role": "user"}]}', "messages[0].content must be a string"),
    ('{"messages": [{"role": 3, "content": "x"}]}', "messages[0].role must be a string"),
    ('{"messages": [' * 40 + ']' * 40 + '}', "nested deeper"),
    ('not json', "not valid JSON"),
])
def test_bad_rows_are_refused_in_one_line_naming_file_and_row(tmp_path, row, message):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": TALK[1]}) + "\n\n" + row + "\n")
    with pytest.raises(DataError) as err:
        read_conversations(path)
    assert str(err.value).startswith(f"{path}:3:") and message in str(err.value) and "\n" not in str(err.value)


def test_parquet_rows_and_a_bad_one(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"messages": [TALK[0], TALK[1]]}), path)
    assert [m for _, m in read_conversations(path)] == [TALK[0], TALK[1]]
    pq.write_table(pa.table({"messages": [TALK[1], [{"role": "user", "content": None}]]}), path)
    with pytest.raises(DataError, match=rf"^{path}:2: messages\[0\].content"):
        read_conversations(path)


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    moving = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ messages | length }}"
    with pytest.raises(DataError, match=r"c.jsonl:1: the chat template renders turns .* differently"):
        ChatEncoder(compile_template(moving, {}), "byte")(TALK[1], f"{tmp_path}/c.jsonl:1")


def test_checks_without_reading_rows(tmp_path):
    d = tokenizer_dir(tmp_path / "tok")
    path = jsonl(tmp_path / "c.jsonl")
    assert check_data(section(path, tokenizer=str(d)), seq_len=64, vocab=300) == []
    assert tokenizer_json(d) == d / "tokenizer.json" and tokenizer_json(d / "tokenizer.json") == d / "tokenizer.json"
    fields = dict(check_data(section(path), seq_len=64, vocab=300))
    assert "has no chat template" in fields["chat_template"]
    (tmp_path / "c.txt").write_text("x")
    fields = dict(check_data(section(tmp_path / "c.txt", tokenizer=str(d)), seq_len=64, vocab=300))
    assert ".jsonl or .parquet" in fields["path"]
    fields = dict(check_data(section(path, tokenizer=str(d)), seq_len=64, vocab=100))
    assert "more than model.vocab 100" in fields["tokenizer"]
    (d / "tokenizer_config.json").write_text("{}")
    assert "has no chat_template" in dict(check_data(section(path, tokenizer=str(d)), seq_len=64, vocab=300))["chat_template"]
    (d / "chat_template.jinja").write_text(CHATML)  # where newer transformers save it
    assert check_data(section(path, tokenizer=str(d)), seq_len=64, vocab=300) == []
    (d / "tokenizer_config.json").write_text("[" * 100 + "]" * 100)
    assert "nested deeper" in dict(check_data(section(path, tokenizer=str(d)), seq_len=64, vocab=300))["chat_template"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "is a directory; a model directory needs its tokenizer.json" in dict(check_data(section(path, tokenizer=str(empty)), seq_len=64, vocab=300))["tokenizer"]


def test_text_source_and_tokenize_take_a_model_directory(tmp_path):
    from trainer.data.corpus.inspect import inspect_tokens
    from trainer.data.corpus.tokenize import load_spec, tokenize_corpus
    from trainer.data.loader import build_loader

    d = tokenizer_dir(tmp_path / "tok")
    assert load_spec(str(d)).eos == load_spec(str(d / "tokenizer.json")).eos
    (tmp_path / "t.txt").write_text(" ".join(m["content"] for t in TALK for m in t) * 20)
    for name, tok in (("dir", d), ("file", d / "tokenizer.json")):  # `mantra data tokenize --tokenizer DIR`
        tokenize_corpus([str(tmp_path / "t.txt")], tmp_path / f"{name}.bin", tokenizer=str(tok), progress=False)
    assert (tmp_path / "dir.bin").read_bytes() == (tmp_path / "file.bin").read_bytes()
    assert inspect_tokens(tmp_path / "dir.bin", tokenizer=str(d)).sample.startswith("be brief hello fine thanks")
    data = DataSection(source="text", path=str(tmp_path / "t.txt"), tokenizer=str(d))
    assert check_data(data, seq_len=16, vocab=300) == []
    ld = build_loader(data, seq_len=16, vocab=300, seed=0, global_batch=2, micro_batch=2, microbatches=1, prefetch=0)
    assert ld.stream.n_tokens > 100
