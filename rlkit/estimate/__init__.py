"""Memory before launch: what each process of a recipe holds, from the model's config.json only.

    rlkit estimate RECIPE [--hardware 8xA100-80G | 2x8x910B-64G | ...] [key.sub=value ...]

No weights are loaded: a 32B model is estimated on a laptop. Per process kind (a learner rank, a
rollout engine, a colocated learner + engine), the memory by part, then a verdict for one device
of the hardware given, and the changes that make a plan that does not fit fit.

`arch.py` reads the model, `memory.py` models the processes (a learner rank, an engine, one that
hosts the other) that each stage's memory model (`sft/memory.py`, `grpo/memory.py`, named by
its row in `rlkit.stages`) puts together, `plan.py` says what fits and what would make it fit.
"""

from rlkit.estimate.arch import PUBLISHED, Arch, config_json
from rlkit.estimate.memory import GIB, Hardware, MemoryModel, Process, estimate, model_states, verdicts
from rlkit.estimate.plan import check_before_launch, fixes, report

__all__ = ["GIB", "PUBLISHED", "Arch", "Hardware", "MemoryModel", "Process", "check_before_launch", "estimate",
           "config_json", "fixes", "model_states", "report", "verdicts"]
