"""Rows the data tests share, and the files they are written to."""

from __future__ import annotations

import json

ROWS = [
    {"instruction": "请解释什么是深度学习", "input": "", "output": "深度学习是...", "difficulty": "explain"},
    {"instruction": "求和", "input": "1+2", "output": "3", "difficulty": "reasoning", "id": 7},
]


def write_json(path, rows):
    path.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    return str(path)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return str(path)
