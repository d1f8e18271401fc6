"""A quiet console: library output of the driver and of the actors goes, complete, to the run's
logs/; rlkit's own lines stay (each in a fresh interpreter: the setup changes process-wide state)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests.helpers import ROOT


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **env})


def test_the_driver_keeps_rlkit_lines_and_logs_the_libraries(tmp_path):
    out = _python(f"""
        import logging, warnings
        from pathlib import Path
        from rlkit import console
        console.quiet_driver()
        import deepspeed  # says "Setting accelerator to CPU" on its own logger as it is imported
        import ray
        console.quiet_driver()  # as start_ray does once Ray is imported
        logging.getLogger("ray._private.worker").warning("a Ray warning")
        logging.getLogger("ray").handlers.clear()  # what ray.init(configure_logging=False) does
        logging.getLogger("ray._private.authentication").warning("a Ray warning without a handler")
        logging.getLogger("transformers.modeling_utils").warning("a transformers warning")
        warnings.warn("a Python warning")
        logging.getLogger("rlkit").warning("an rlkit warning")
        console.driver_log(Path({str(tmp_path)!r}))
        logging.getLogger("vllm").warning("after the run folder is known")
    """)
    assert out.returncode == 0, out.stderr
    assert (out.stdout + out.stderr).splitlines() == ["rlkit: an rlkit warning"]
    log = (tmp_path / "logs" / "driver.log").read_text()
    for line in ("WARNING DeepSpeed: Setting accelerator to CPU", "WARNING ray._private.worker: a Ray warning",
                 "a Ray warning without a handler", "WARNING transformers.modeling_utils: a transformers warning",
                 "UserWarning: a Python warning", "WARNING vllm: after the run folder is known"):
        assert line in log, (line, log)
    assert "an rlkit warning" not in log


def test_verbose_leaves_the_console_as_the_libraries_print_it(tmp_path):
    out = _python("""
        import logging
        from rlkit import console
        console.quiet_driver()
        import deepspeed
        assert not console.quiet() and console.worker_runtime_env(None) == {}
    """, RLKIT_VERBOSE="1")
    assert out.returncode == 0, out.stderr
    assert "Setting accelerator to CPU" in out.stdout + out.stderr


def test_an_actor_process_writes_everything_to_its_named_log(tmp_path):
    out = _python("""
        import os, sys, ctypes
        from rlkit import console
        console.setup_worker()  # what Ray runs as the worker_process_setup_hook
        print("python stdout")
        print("python stderr", file=sys.stderr)
        os.write(2, b"fd 2, as C++ and subprocesses write\\n")
        console.name_worker_log("learner-3")
        print("after naming", flush=True)
        os.system("echo a child process")
    """, RLKIT_LOG_DIR=str(tmp_path))
    assert out.returncode == 0 and out.stdout == out.stderr == "", out.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["learner-3.log"]
    text = (tmp_path / "learner-3.log").read_text()
    for line in ("python stdout", "python stderr", "fd 2, as C++ and subprocesses write", "after naming",
                 "a child process"):
        assert line in text, (line, text)


def test_a_restarted_actor_keeps_the_first_ones_log(tmp_path):
    (tmp_path / "engine-0.log").write_text("the first engine 0\n")
    code = "from rlkit import console\nconsole.setup_worker()\nprint('again')\nconsole.name_worker_log('engine-0')\n"
    out = _python(code, RLKIT_LOG_DIR=str(tmp_path))
    assert out.returncode == 0, out.stderr
    logs = sorted(p.name for p in tmp_path.iterdir())
    assert len(logs) == 2 and "engine-0.log" in logs
    again = next(name for name in logs if name != "engine-0.log")
    assert again.startswith("engine-0-") and (tmp_path / again).read_text() == "again\n"
    assert (tmp_path / "engine-0.log").read_text() == "the first engine 0\n"
