"""A run's infrastructure, shared by every stage: the driver's steps before launch and the
learner group (`driver.py`), the run directory (`rundir.py`), checkpoints and resume
(`checkpoint.py`), stop signals, reruns of a finished run, the metrics log."""
