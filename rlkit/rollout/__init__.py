"""The rollout side: the vLLM generators. An engine in its actor (`worker.py`, with its worker
extension `vllm_ext.py`), the engines as a group, apart (`separate.py`) or inside the learners
(`engines.py`), the recipe's sampling over them (`generation.py`, `samples.py`, `streaming.py`),
what vLLM can serve (`serving.py`), the `rollout` section (`config.py`), the buckets an engine loads
(`buckets.py`) and what it takes from the learners without knowing them (`policy.py`). It imports
nothing of the learner side nor of `rlkit/sync/` (tests/test_structure.py)."""
