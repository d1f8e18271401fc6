"""What a teacher must share with its student before anything starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlkit.errors import ConfigError


def check_teacher(teacher: Any, student_tokenizer: str, device: Any) -> None:
    """Before launch: the teacher's precision on this device, its kernels, and its tokenizer (the
    student's, `student_tokenizer`); its path is checked with every model the recipe names
    (`rlkit.model.checks.check_model`)."""
    from rlkit.accel import check_precision
    from rlkit.model.facts import model_facts
    from rlkit.model.kernels import check_kernels

    check_precision(teacher.dtype, device, "distill.teacher.dtype")
    check_kernels(teacher, device, model_facts(teacher).model_type, "distill.teacher.kernels")
    check_same_tokenizer(student_tokenizer, teacher.tokenizer or teacher.path)


def check_distill(cfg: Any, device: Any) -> None:
    """A stage check before launch (`driver.prepare_inputs`): a recipe's `distill.teacher`, if it
    has one, against the student (`model`) and the device."""
    if cfg.distill is not None:
        check_teacher(cfg.distill.teacher, cfg.model.tokenizer or cfg.model.path, device)


def check_teacher_node(distill: Any) -> None:
    """Once Ray is up: the node `distill.node` names is one of the cluster's (one line otherwise)."""
    from rlkit.actors.cluster import cluster_nodes

    if distill is None or not distill.node:
        return
    nodes = [name.rstrip("'") for name in cluster_nodes()]
    if distill.node not in nodes:
        raise ConfigError(f"{distill.node} is not a node of this Ray cluster (its nodes: {', '.join(nodes)}): give "
                          "one of those addresses, or null to let Ray place the teacher", "distill.node")


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
