"""User errors: everything a user can fix derives from `UserError`.

The CLI prints `rlkit: error: <message>` (one line) and exits 2 for any of them, and never a
traceback. A message names where the problem is (file, row, key, actor) and what to do.

`key` is set where the error belongs to a recipe key: the recipe loader then prefixes it with
the file and the key's full path (`recipes/x.yaml: rewards[0].weight: ...`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class UserError(Exception):
    """Any error the user can fix; its message is one line."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key
        self.message = message


class ConfigError(UserError, ValueError):
    """A recipe problem: unknown key, wrong type, a cross-field rule."""


class DataError(UserError, ValueError):
    """A data problem: the message names the file and the row (or the field)."""


class RewardError(UserError, ValueError):
    """A reward function is misconfigured or failed; names the reward and the sample."""


class FaultError(UserError):
    """A fault during a run: an actor hung past its timeout, or a weight sync left an engine with
    other weights than the learner's. Names the actor and the phase; checkpoints already written
    are intact, so `resume: auto` continues from the last one."""


class Stopped(Exception):
    """The run stopped on a signal (SIGTERM, SIGINT): after saving a checkpoint at the end of the
    current step (`stops.EXIT_STOPPED`, 3), or at once on a second signal (128 + the signal's number)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def read_json(path: str | Path, expect: type = dict, what: str = "a JSON object",
              error: type[UserError] = UserError) -> Any:
    """The JSON a user's file holds, or one line naming the file: missing, unreadable, the line of
    invalid JSON, or a value other than `expect` (`what` says what was expected)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{path}: cannot read file ({getattr(e, 'strerror', None) or e})") from None
    return parse_json(text, path, expect, what, error)


def parse_json(text: str, path: str | Path, expect: type = dict, what: str = "a JSON object",
               error: type[UserError] = UserError) -> Any:
    """`text` (read from `path`) as JSON of type `expect`, or one line naming the file: the line of
    invalid JSON, or a value other than `expect`."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}: line {e.lineno}: invalid JSON ({e.msg})") from None
    if not isinstance(value, expect):
        raise error(f"{path}: expected {what}, got {type(value).__name__}")
    return value
