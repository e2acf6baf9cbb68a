"""Datasets: jsonl, parquet and ``save_to_disk`` folders read with a column mapping;
conversational prompts rendered by the chat template; overlong prompts filtered, truncated or
refused when the dataset is read; shuffled per epoch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from asyncflow_actors.models import CharTokenizer
from asyncflow_actors.rl import TaskError
from asyncflow_actors.tasks import DatasetSettings, DatasetTask, read_records

TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
RECORDS = [
    {"q": [{"role": "user", "content": "1+2="}], "sol": "3", "level": 1},
    {"q": [{"role": "user", "content": "10+20="}], "sol": "30", "level": 2},
    {"q": [{"role": "user", "content": "100+200+300="}], "sol": "600", "level": 3},
]


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def chat_tokenizer() -> Any:
    pytest.importorskip("transformers")
    from asyncflow_actors.roles._hf_policy import HFTokenizer
    from asyncflow_actors.rollout._hf_export import hf_char_tokenizer

    fast = hf_char_tokenizer(CharTokenizer("0123456789+=:\nusa"))
    fast.chat_template = TEMPLATE
    return HFTokenizer(fast)


def settings(path: str, **kw: Any) -> DatasetSettings:
    return DatasetSettings(path=path, prompt_column="q", answer_column="sol", **kw)


def test_jsonl_parquet_and_saved_datasets_read_alike(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    jsonl = write_jsonl(tmp_path / "d.jsonl", RECORDS)
    table = datasets.Dataset.from_list(RECORDS)
    table.to_parquet(str(tmp_path / "d.parquet"))
    datasets.DatasetDict({"train": table}).save_to_disk(str(tmp_path / "saved"))
    expected = [{"prompt": r["q"], "answer": r["sol"], "level": r["level"]} for r in RECORDS]
    for path in (jsonl, str(tmp_path / "d.parquet"), str(tmp_path / "saved")):
        assert read_records(settings(path)) == expected, path
    with pytest.raises(TaskError, match="no prompt column 'question'"):
        read_records(DatasetSettings(path=jsonl, prompt_column="question"))


def test_conversational_prompts_go_through_the_chat_template(tmp_path: Path) -> None:
    task = DatasetTask.read(settings(write_jsonl(tmp_path / "d.jsonl", RECORDS)))
    prepared = task.prepare(chat_tokenizer(), None, shuffle=False)
    assert prepared.problem(0).prompt == "u:1+2=\na:"
    assert prepared.problem(0).metadata == {"prompt": RECORDS[0]["q"], "answer": "3", "level": 1}
    with_system = DatasetTask.read(
        settings(str(tmp_path / "d.jsonl"), system_prompt="add")
    ).prepare(chat_tokenizer(), None, shuffle=False)
    assert with_system.problem(1).prompt == "s:add\nu:10+20=\na:"
    with pytest.raises(TaskError, match="chat template"):
        task.prepare(CharTokenizer("0123456789+=:\nusa"), None)


def test_string_prompts_stay_as_they_are(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "2+2=", "answer": 4}])
    task = DatasetTask.read(DatasetSettings(path=path, system_prompt="sum"))
    tokenizer = CharTokenizer(task.alphabet)
    assert task.prepare(tokenizer, None).problem(0).prompt == "sum\n2+2="


@pytest.mark.parametrize("overlong", ["filter", "truncate_left", "error"])
def test_an_overlong_prompt(tmp_path: Path, overlong: str) -> None:
    task = DatasetTask.read(settings(write_jsonl(tmp_path / "d.jsonl", RECORDS), overlong=overlong))
    tokenizer = chat_tokenizer()
    limit = 12  # "u:100+200+300=\na:": 17 characters and the BOS the tokenizer prepends
    if overlong == "error":
        with pytest.raises(TaskError, match="record 2: prompt of 18 tokens exceeds"):
            task.prepare(tokenizer, limit)
        return
    prepared = task.prepare(tokenizer, limit, shuffle=False)
    if overlong == "filter":
        assert len(prepared.problems) == 2 and prepared.filtered == 1
        assert [p.answer for p in prepared.problems] == ["3", "30"]
    else:
        assert prepared.truncated == 1 and len(prepared.problems) == 3
        text = prepared.problems[2].prompt
        assert text == "u:100+200+300=\na:"[-11:]
        assert len(tokenizer.encode(text, add_bos=True)) <= limit


def test_shuffled_per_epoch_and_cycled(tmp_path: Path) -> None:
    records = [{"prompt": str(i), "answer": str(i)} for i in range(10)]
    task = DatasetTask.read(DatasetSettings(path=write_jsonl(tmp_path / "d.jsonl", records)))
    prepared = task.prepare(CharTokenizer(task.alphabet), None)
    first = [prepared.problem(i).answer for i in range(10)]
    second = [prepared.problem(i).answer for i in range(10, 20)]
    assert sorted(first) == sorted(second) == [str(i) for i in range(10)]
    assert first != second and first != sorted(first, key=int)
    again = task.prepare(CharTokenizer(task.alphabet), None)
    assert [again.problem(i).answer for i in range(20)] == first + second


def test_a_process_reads_an_unchanged_file_once(tmp_path: Path) -> None:
    """The preflight, the Driver and the stations of one process build the task each: they
    share one read while the file is unchanged, and see a changed file anew."""
    path = write_jsonl(tmp_path / "d.jsonl", RECORDS)
    settings = DatasetSettings(path=path, prompt_column="q", answer_column="sol")
    first, second = DatasetTask.read(settings), DatasetTask.read(settings)
    assert second.records is first.records
    write_jsonl(tmp_path / "d.jsonl", RECORDS[:2])
    third = DatasetTask.read(settings)
    assert [r["answer"] for r in third.records] == ["3", "30"]
    other = DatasetTask.read(DatasetSettings(path=path, prompt_column="q", answer_column="level"))
    assert [r["answer"] for r in other.records] == [1, 2]
