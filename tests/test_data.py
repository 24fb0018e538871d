"""Prompt sources, templates, tokenizers and the resumable prompt dataset."""
import json

import pytest

from megatron_calibclip.config import ConfigError
from megatron_calibclip.data import (
    DataError,
    PromptDataset,
    PromptRecord,
    PromptTemplate,
    SentencePieceTokenizer,
    SkipCounter,
    TokenizerError,
    load_tokenizer,
    read_jsonl,
    reasoning_gym_records,
    train_sentencepiece,
)

TEXTS = [f"Question: {a} + {b} = ?\nAnswer: {a + b}" for a in range(30) for b in range(7)]


@pytest.fixture(scope="module")
def sp_tokenizer(tmp_path_factory):
    path = train_sentencepiece(TEXTS, tmp_path_factory.mktemp("sp") / "tok", vocab_size=120)
    return SentencePieceTokenizer(path)


def test_sentencepiece_roundtrip_and_specials(sp_tokenizer):
    text = "Question: 12 + 5 = ?\nAnswer: 17"
    ids = sp_tokenizer.encode(text)
    assert ids[0] == sp_tokenizer.bos_id == 1
    assert sp_tokenizer.eos_id == 2 and sp_tokenizer.pad_id == 0
    assert all(0 <= i < sp_tokenizer.vocab_size for i in ids)
    # digits are split, so every number is a sequence of single-digit pieces
    digit_pieces = [sp_tokenizer.decode([i]) for i in sp_tokenizer.encode("1234")[1:]]
    assert [p.strip() for p in digit_pieces if p.strip()] == ["1", "2", "3", "4"]
    assert sp_tokenizer.decode(ids).replace(" ", "") == text.replace(" ", "").replace("\n", "")
    assert sp_tokenizer.decode(ids + [sp_tokenizer.eos_id, sp_tokenizer.pad_id]) == \
        sp_tokenizer.decode(ids)


def test_training_is_deterministic(tmp_path):
    a = train_sentencepiece(TEXTS, tmp_path / "a", vocab_size=100).read_bytes()
    b = train_sentencepiece(TEXTS, tmp_path / "b", vocab_size=100).read_bytes()
    assert a == b


def test_tokenizer_errors(tmp_path):
    with pytest.raises(TokenizerError, match="not found"):
        load_tokenizer(tmp_path / "missing.model")
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match="is not a sentencepiece model"):
        SentencePieceTokenizer(bad)


def _write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_reads_records_and_names_bad_lines(tmp_path):
    good = _write_jsonl(tmp_path / "good.jsonl", [
        json.dumps({"prompt": "1+1?", "answer": 2}), "", json.dumps({"prompt": "2+2?",
                                                                    "answer": "4"})])
    recs = read_jsonl(good)
    assert [(r.prompt, r.answer, r.source) for r in recs] == [
        ("1+1?", "2", "good.jsonl:1"), ("2+2?", "4", "good.jsonl:3")]
    cases = [
        (json.dumps({"prompt": "x"}), r"bad.jsonl:2: missing field\(s\): \['answer'\]"),
        (json.dumps({"prompt": "  ", "answer": 1}), "bad.jsonl:2: empty prompt"),
        ("{not json", "bad.jsonl:2: invalid JSON"),
        ("[1, 2]", "bad.jsonl:2: not a JSON object"),
    ]
    for line, match in cases:
        path = _write_jsonl(tmp_path / "bad.jsonl", [json.dumps({"prompt": "a", "answer": 1}),
                                                     line])
        with pytest.raises(DataError, match=match):
            read_jsonl(path)
        skips = SkipCounter()
        assert len(read_jsonl(path, on_bad="skip", skips=skips)) == 1
        assert skips.total == 1  # counted, not silently dropped
    with pytest.raises(DataError, match="not found"):
        read_jsonl(tmp_path / "none.jsonl")


def test_custom_keys(tmp_path):
    path = _write_jsonl(tmp_path / "k.jsonl", [json.dumps({"question": "q", "solution": "s"})])
    assert read_jsonl(path, prompt_key="question", answer_key="solution")[0].answer == "s"


@pytest.mark.parametrize("task", ["chain_sum", "basic_arithmetic", "countdown", "gsm_symbolic"])
def test_reasoning_gym_tasks_are_seeded(task):
    a = reasoning_gym_records(task, 3, seed=5)
    b = reasoning_gym_records(task, 3, seed=5)
    assert [r.prompt for r in a] == [r.prompt for r in b] and len(a) == 3
    assert all(r.prompt and r.answer and r.entry is not None for r in a)
    assert a[0].source == f"reasoning_gym:{task}:0"


def test_unknown_reasoning_gym_task():
    with pytest.raises(DataError, match="no_such_task"):
        reasoning_gym_records("no_such_task", 2, seed=0)


def test_template():
    assert PromptTemplate().render("2+2?") == "Question: 2+2?\nAnswer:"
    assert PromptTemplate(text="Q={prompt} A=").render("x") == "Q=x A="
    with pytest.raises(ConfigError, match="must contain"):
        PromptTemplate(text="no placeholder")
    with pytest.raises(ConfigError, match="needs a Hugging Face tokenizer"):
        PromptTemplate(kind="chat").render("x", tokenizer=None)


def _records(n):
    return [PromptRecord(f"{i} + 1 = ?", str(i + 1), f"mem:{i}") for i in range(n)]


def test_dataset_batches_are_seeded_and_resumable(sp_tokenizer):
    ds = PromptDataset(_records(10), sp_tokenizer, seed=3)
    first = [p.record.source for p in ds.next_batch(4)]
    state = ds.state_dict()
    rest = [p.record.source for p in ds.next_batch(12)]  # crosses into epoch 1
    assert sorted(first + rest[:6]) == sorted(f"mem:{i}" for i in range(10))  # epoch 0
    resumed = PromptDataset(_records(10), sp_tokenizer, seed=3)
    resumed.load_state_dict(state)
    assert [p.record.source for p in resumed.next_batch(12)] == rest
    other_seed = PromptDataset(_records(10), sp_tokenizer, seed=4)
    assert [p.record.source for p in other_seed.next_batch(10)] != first + rest[:6]
    with pytest.raises(DataError, match="data cursor was saved for 10 prompts"):
        PromptDataset(_records(9), sp_tokenizer, seed=3).load_state_dict(state)


def test_too_long_prompts_error_or_counted_skip(sp_tokenizer):
    recs = _records(3) + [PromptRecord("1 + " * 200, "x", "mem:long")]
    with pytest.raises(DataError, match=r"mem:long: prompt has \d+ tokens > max_prompt_tokens 40"):
        PromptDataset(recs, sp_tokenizer, max_prompt_tokens=40)
    ds = PromptDataset(recs, sp_tokenizer, max_prompt_tokens=40, on_too_long="skip")
    assert len(ds) == 3 and ds.skips.skipped == {"prompt too long": 1}
    with pytest.raises(DataError, match="no usable prompts"):
        PromptDataset(recs[3:], sp_tokenizer, max_prompt_tokens=40, on_too_long="skip")
