"""The files users bring: parquet, CSV/TSV, Arrow (file and stream), compressed JSONL, shards of
them and dataset_info entries naming them, read to the same rows as the JSONL; every problem one
line naming the file (and the column or row)."""

from __future__ import annotations

import bz2
import json
import lzma

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

from rlkit.data.formats import load_prompts, load_rows
from rlkit.errors import DataError
from tests.conftest import CONTAINERS


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("ext", CONTAINERS)
def test_each_container_reads_to_the_jsonl_rows(task_data, task_containers, ext):
    copy = task_containers[ext]
    for name in ("sft_train", "sft_eval"):
        assert load_rows(str(copy[name])).rows == load_rows(str(task_data[name])).rows
    for name in ("grpo_train", "grpo_eval"):
        assert load_prompts(str(copy[name])).rows == load_prompts(str(task_data[name])).rows


@pytest.mark.parametrize("ext, opener", [("jsonl.bz2", bz2.open), ("jsonl.xz", lzma.open), ("json.gz", None)])
def test_other_compressions_and_a_gzip_json_list(task_data, tmp_path, ext, opener):
    import gzip

    rows = _rows(task_data["sft_eval"])
    path = tmp_path / f"rows.{ext}"
    with (opener or gzip.open)(path, "wt", encoding="utf-8") as f:
        f.write(json.dumps(rows, ensure_ascii=False) if ext == "json.gz" else
                "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    assert load_rows(str(path)).rows == load_rows(str(task_data["sft_eval"])).rows


def test_tsv_and_an_arrow_stream_as_datasets_caches_it(task_data, tmp_path):
    rows = _rows(task_data["sft_eval"])
    table = pa.Table.from_pylist(rows)
    pcsv.write_csv(table, tmp_path / "rows.tsv", pcsv.WriteOptions(delimiter="\t"))
    with pa.OSFile(str(tmp_path / "cache.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        for batch in table.to_batches(max_chunksize=10):
            w.write_batch(batch)
    want = load_rows(str(task_data["sft_eval"])).rows
    assert load_rows(str(tmp_path / "rows.tsv")).rows == want
    assert load_rows(str(tmp_path / "cache.arrow")).rows == want


def test_csv_cells_stay_text(tmp_path):
    """Arrow would read a column of digits as integers: an answer '007' must stay '007'."""
    (tmp_path / "p.csv").write_text('prompt,answer\n"1,2: sum?",007\nwhat is 3+4?,7\n')
    rows = load_prompts(str(tmp_path / "p.csv")).rows
    assert [(r["prompt"], r["answer"]) for r in rows] == [("1,2: sum?", "007"), ("what is 3+4?", "7")]


def test_a_missing_column_is_one_line_naming_file_and_column(task_data, tmp_path):
    table = pa.Table.from_pylist(_rows(task_data["sft_train"])).drop_columns(["output"])
    pq.write_table(table, tmp_path / "no_output.parquet")
    with pytest.raises(DataError, match=r"no_output.parquet: has no column 'output', which alpaca rows \(instruction, "
                                        r"output\) need \(its columns: instruction, input, difficulty\)"):
        load_rows(str(tmp_path / "no_output.parquet"))
    (tmp_path / "p.csv").write_text("question,answer\nwhat is 3+4?,7\n")
    with pytest.raises(DataError, match=r"p.csv: row 1: cannot tell the format"):
        load_prompts(str(tmp_path / "p.csv"))
    pq.write_table(pa.table({"prompt": ["a"], "answer": ["b"]}), tmp_path / "p1.parquet")
    pq.write_table(pa.table({"question": ["a"], "answer": ["b"]}), tmp_path / "p2.parquet")
    with pytest.raises(DataError, match=r"p2.parquet: has no column 'prompt', which GRPO prompt rows need"):
        load_prompts(str(tmp_path / "p*.parquet"))


def test_a_dataset_info_entry_names_a_parquet_file_with_its_own_columns(task_data, tmp_path):
    rows = [{"question": r["instruction"] + r["input"], "response": r["output"]} for r in _rows(task_data["sft_eval"])]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "mine.parquet")
    (tmp_path / "dataset_info.json").write_text(json.dumps({"mine": {
        "file_name": "mine.parquet", "columns": {"prompt": "question", "response": "response"}}}))
    loaded = load_rows(str(tmp_path), dataset="mine")
    assert [(r["instruction"], r["output"]) for r in loaded.rows] == [(r["question"], r["response"]) for r in rows]
    (tmp_path / "dataset_info.json").write_text(json.dumps({"mine": {
        "file_name": "mine.parquet", "columns": {"prompt": "question", "response": "answer"}}}))
    with pytest.raises(DataError, match=r"mine.parquet: has no column 'answer', which alpaca rows"):
        load_rows(str(tmp_path), dataset="mine")


def test_shards_in_a_folder_or_a_glob_with_the_hubs_split_names(task_data, tmp_path):
    rows = _rows(task_data["sft_train"])[:30]
    data = tmp_path / "hub" / "data"
    data.mkdir(parents=True)
    (tmp_path / "hub" / "README.md").write_text("# a dataset card")
    for i, part in enumerate((rows[:10], rows[10:20])):
        pq.write_table(pa.Table.from_pylist(part), data / f"train-0000{i}-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(rows[20:]), data / "test-00000-of-00001.parquet")
    want = load_rows(str(task_data["sft_train"])).rows
    assert load_rows(str(tmp_path / "hub")).rows == want[:20]                 # train by default
    assert load_rows(str(tmp_path / "hub"), split="test").rows == want[20:30]
    assert load_rows(str(data / "*.parquet")).rows == [*want[20:30], *want[:20]]  # a glob: every file, sorted
    with pytest.raises(DataError, match=r"hub: split 'validation' not found \(its files have test, train\)"):
        load_rows(str(tmp_path / "hub"), split="validation")
    bad = dict(rows[15], output="")
    pq.write_table(pa.Table.from_pylist([*rows[10:15], bad]), data / "train-00001-of-00002.parquet")
    with pytest.raises(DataError, match=r"hub: row 6 of train-00001-of-00002.parquet: field 'output' is empty"):
        load_rows(str(tmp_path / "hub"))
    (data / "extra.jsonl").write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(DataError, match=r"data: holds JSONL and parquet files; name the ones to read with a glob"):
        load_rows(str(data))


@pytest.mark.parametrize("name, content, message", [
    ("broken.parquet", b"PAR1 not really", r"broken.parquet: cannot read it as a parquet file \("),
    ("broken.arrow", b"not arrow at all", r"broken.arrow: cannot read it as an Arrow file \("),
    ("ragged.csv", b"instruction,output\na,b\nc,d,e\n",
     r"ragged.csv: cannot read it as a CSV file \(CSV parse error: Row #3: Expected 2 columns, got 3"),
    ("broken.jsonl.gz", b"not gzip", r"broken.jsonl.gz: cannot read file \("),
    ("rows.xlsx", b"", r"rows.xlsx: unsupported file type \(expected .json, .jsonl \(either .gz, .bz2 or .xz too\), "
                       r".parquet, .csv, .tsv, .arrow or .feather"),
])
def test_a_broken_file_is_one_line(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError, match="^.*" + message) as e:
        load_rows(str(tmp_path / name))
    assert "\n" not in str(e.value)


def test_a_glob_that_matches_nothing_or_a_foreign_file(tmp_path):
    with pytest.raises(DataError, match=r"nothing\*.parquet: no file matches"):
        load_rows(str(tmp_path / "nothing*.parquet"))
    (tmp_path / "a.parquet").write_bytes(b"")
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(DataError, match=r"a\.\*: matches .*a.txt, which is not a file of rows"):
        load_rows(str(tmp_path / "a.*"))
