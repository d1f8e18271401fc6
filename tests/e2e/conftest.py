"""The end-to-end runs' fixtures: the calculator task's tool-calling model (the multi-turn GRPO
runs). The tiny model, its task and the SFT-trained start model are tests/conftest.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import tool_task_script
from tests.workers import once


@pytest.fixture(scope="session")
def tool_task(tmp_path_factory) -> dict[str, Path]:
    """The tiny tool-calling model, the calculator task's data (`write_tool_task`) and the model
    after the script's TOOL_STEPS SFT steps on its tool-use transcripts (it calls `add` with the
    question's numbers and copies the result into its answer). Built once for both workers."""

    def build(root: Path) -> dict[str, Path]:
        from rlkit.tiny import build_tiny_model
        from rlkit.tiny_tools import write_tool_task

        model = build_tiny_model(root / "model", "tiny", tools=True)
        data = write_tool_task(root / "data")
        script = tool_task_script()
        tools = script.sft(model, data["sft_tools"], root / "sft-tools", script.TOOL_STEPS, root)
        return {"root": root, "model": model, "tools": tools, **data}

    return once(tmp_path_factory, "tool-task", build)


@pytest.fixture(scope="session")
def mixed_tool_model(tool_task, tmp_path_factory) -> Path:
    """The transcripts' model after 120 SFT steps on the mixed rows (the tool offered in every row,
    30% of them transcripts): it can use `add` but seldom calls it (the script's GRPO start)."""
    script = tool_task_script()
    return once(tmp_path_factory, "tool-task-mixed",
                lambda work: script.sft(tool_task["tools"], tool_task["sft_mixed"], work / "sft-mixed", 120, work,
                                        lr=1e-3, packing=True))
