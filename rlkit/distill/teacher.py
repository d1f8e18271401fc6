"""What a teacher must share with its student before anything starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlkit.errors import ConfigError


def check_teacher(teacher: Any, student_tokenizer: str, device: Any) -> None:
    """Before launch: the teacher's precision on this device, its path, and its tokenizer (the
    student's, `student_tokenizer`)."""
    from rlkit.accel import check_precision
    from rlkit.models import check_model_path

    check_precision(teacher.dtype, device, "distill.teacher.dtype")
    check_model_path(teacher.path, "distill.teacher.path")
    check_same_tokenizer(student_tokenizer, teacher.tokenizer or teacher.path)


def check_same_tokenizer(student: str | Path, teacher: str | Path, key: str = "distill.teacher") -> None:
    """One line unless the two model directories tokenize alike: the same vocabulary (every token
    at the same id) and the same special tokens. The teacher scores the student's token ids, so
    another tokenizer would score other text."""
    from transformers import AutoTokenizer

    s, t = AutoTokenizer.from_pretrained(str(student)), AutoTokenizer.from_pretrained(str(teacher))
    vs, vt = s.get_vocab(), t.get_vocab()
    if vs != vt:
        only = sorted(set(vs.items()) ^ set(vt.items()), key=lambda kv: kv[1])[0]
        where = "student" if only in vs.items() else "teacher"
        raise ConfigError(f"the teacher {teacher} and the student {student} have other tokenizers ({len(vt)} and "
                          f"{len(vs)} tokens; token {only[0]!r} is id {only[1]} in the {where}'s only): on-policy "
                          "distillation needs one tokenizer (choose a teacher of the student's family)", key)
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if getattr(s, name) != getattr(t, name):
            raise ConfigError(f"the teacher {teacher} and the student {student} differ in {name} ({getattr(t, name)} "
                              f"vs {getattr(s, name)}): on-policy distillation needs one tokenizer", key)
