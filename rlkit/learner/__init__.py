"""The learner side: the DeepSpeed policy learners. A learner in its actor (`actor.py`), the learners
as one torch.distributed group (`group.py`), the objective a stage gives them (`objective.py`),
token logprobs and the fused head (`logprobs.py`, `head.py`), the DeepSpeed config, throughput and
MFU, checkpoints, the weights as the engines take them (`weights.py`), a distillation teacher. It
reaches the engines only through `rlkit/sync/` (tests/test_structure.py)."""
