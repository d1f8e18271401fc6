"""What crosses between the rollout side and the learner side, beside the transports' table
(`rlkit/transports.py`): each transport's two ends (`weight_sync.py`: the object store, a
broadcast, in-process, the adapter alone) and an engine colocated in a learner's process
(`colocate.py`). It knows the engines (`rlkit/rollout/`) and no learner; the learners import it."""
