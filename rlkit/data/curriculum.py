"""Curriculum sampler over row indices (seed 002): the difficulty mix shifts by phase.

Phases are ``(end, mix)``: ``end`` is the fraction of training where the phase stops,
``mix`` the share of each level in a batch. Step ``s`` is in the first phase with
``s / total_steps < end`` (steps past the end stay in the last phase).

Per-batch level counts: smooth weighted round-robin. For each of the batch's slots every
level's credit grows by its share and the level with the most credit (ties: level order)
takes the slot and pays 1; credits reset at each phase start. It is deterministic, never
gives a level with share 0 a slot, and the running count per level stays within a few
rows of share x rows drawn, so the long-run mix is the schedule's (per-sample multinomial
draws would only match in expectation). The batch is then shuffled.

Rows of a level come from a shuffled pool, drawn without replacement and reshuffled when
exhausted, so a level with few rows is reused to fill its share. An optional ``row_filter``
(GRPO's online difficulty) may skip a drawn row for this pass; it sees the sampler's RNG and
its state is saved with the sampler's. A level with no rows that
a phase asks for is dropped from that phase and the mix renormalised (logged, and kept in
``adjustments``). Without any difficulty (or ``enabled=False``) it samples plain shuffled
epochs. Everything is seeded; ``state_dict``/``load_state_dict`` resume exactly.
"""

from __future__ import annotations

import bisect
import logging
import random
from collections.abc import Sequence
from typing import Any

from rlkit.errors import DataError

log = logging.getLogger("rlkit")

DEFAULT_LEVELS = ("explain", "reasoning", "topology")
DEFAULT_PHASES = ((0.3, (0.8, 0.2, 0.0)), (0.7, (0.4, 0.4, 0.2)), (1.0, (0.25, 0.35, 0.40)))
_ALL = "*"  # pool key when the curriculum is off


def validate_phases(levels: Sequence[str],
                    phases: Sequence[tuple[float, Sequence[float]]]) -> None:
    """Raise DataError (one line, `key` set: `levels`, `phases[i].until`, ...) unless levels are
    unique non-empty strings and phases have strictly increasing ends in (0, 1] ending at 1,
    each with one non-negative share per level summing to 1 (within 1e-6).

    The recipe's `curriculum` section is checked by this same function."""
    if not levels or len(set(levels)) != len(levels) or not all(isinstance(lv, str) and lv for lv in levels):
        raise DataError(f"levels must be unique non-empty strings, got {list(levels)}", key="levels")
    if not phases:
        raise DataError("the curriculum needs at least one phase", key="phases")
    prev = 0.0
    for i, phase in enumerate(phases):
        if not isinstance(phase, (list, tuple)) or len(phase) != 2:
            raise DataError(f"expected [end_fraction, [shares]], got {phase!r}", key=f"phases[{i}]")
        end, mix = phase
        if isinstance(end, bool) or not isinstance(end, (int, float)) or not prev < end <= 1:
            raise DataError(f"phase ends must increase within (0, 1], got {end!r} after {prev}",
                            key=f"phases[{i}].until")
        if not isinstance(mix, (list, tuple)) or len(mix) != len(levels):
            n = len(mix) if isinstance(mix, (list, tuple)) else "no"
            raise DataError(f"needs one share per level {list(levels)}, got {n}", key=f"phases[{i}].mix")
        if any(isinstance(m, bool) or not isinstance(m, (int, float)) or m < 0 for m in mix):
            raise DataError(f"shares must be non-negative numbers, got {list(mix)}", key=f"phases[{i}].mix")
        if abs(sum(mix) - 1) > 1e-6:
            raise DataError(f"mix {list(mix)} sums to {sum(mix):g}, expected 1", key=f"phases[{i}].mix")
        prev = end
    if prev != 1:
        raise DataError(f"the last phase must end at until: 1.0, got {prev}", key="phases")


class CurriculumSampler:
    """Yields batches of row indices following the difficulty schedule (see module doc).

    ``total_steps`` counts ``next_batch`` calls over the whole run. ``source`` (the data file)
    prefixes errors about the rows' ``difficulty``.
    """

    def __init__(self, difficulties: Sequence[str | None], total_steps: int, batch_size: int,
                 seed: int, levels: Sequence[str] = DEFAULT_LEVELS,
                 phases: Sequence[tuple[float, Sequence[float]]] = DEFAULT_PHASES,
                 enabled: bool = True, source: str | None = None, row_filter: Any = None) -> None:
        if total_steps < 1 or batch_size < 1:
            raise ValueError(f"total_steps and batch_size must be >= 1, got {total_steps}, {batch_size}")
        validate_phases(levels, phases)
        if not difficulties:
            raise DataError(f"{source or 'curriculum sampler'}: the dataset has no rows")
        self.levels = tuple(levels)
        self.phases = tuple((float(e), tuple(float(m) for m in mix)) for e, mix in phases)
        self.total_steps, self.batch_size, self.n_rows = total_steps, batch_size, len(difficulties)
        self.adjustments: list[str] = []
        have = [d is not None for d in difficulties]
        self.curriculum = enabled and any(have)
        if enabled and not self.curriculum:
            log.warning("curriculum: no row has a 'difficulty' field; curriculum is off, "
                        "sampling shuffled epochs")
        if self.curriculum:
            where = f"{source}: " if source else ""
            groups = self._group(self._bucket_numbers(difficulties, where), where)
            self.level_counts = {lv: len(groups[lv]) for lv in self.levels}
            self._mixes = [self._effective_mix(i, mix) for i, (_, mix) in enumerate(self.phases)]
        else:
            groups = {_ALL: list(range(self.n_rows))}
            self.level_counts = {}
            self._mixes = []
        self._pools = groups
        self._pos = {k: len(v) for k, v in groups.items()}  # exhausted: shuffle on first draw
        self._credit = {lv: 0.0 for lv in self.levels}
        self._phase = 0
        self.step = 0
        self._rng = random.Random(seed)
        self.row_filter = row_filter  # accept(row, rng) -> bool, state_dict(), load_state_dict()

    def _bucket_numbers(self, difficulties: Sequence[Any], where: str) -> Sequence[Any]:
        """Numeric difficulties become the levels by equal-count buckets of the sorted values,
        easiest first (ties stay in one bucket); level names pass through."""
        for i, d in enumerate(difficulties):
            if d is not None and (isinstance(d, bool) or not isinstance(d, (str, int, float))):
                raise DataError(f"{where}row {i + 1}: difficulty is {type(d).__name__} (expected a level "
                                f"name such as {self.levels[0]!r} or a number)")
        numbers = [d for d in difficulties if isinstance(d, (int, float))]
        if not numbers:
            return difficulties
        if len(numbers) < sum(d is not None for d in difficulties):
            i = next(i for i, d in enumerate(difficulties) if isinstance(d, str))
            raise DataError(f"{where}row {i + 1}: difficulty {difficulties[i]!r} is a name but other rows "
                            "give numbers; use one kind")
        ordered, k = sorted(numbers), len(self.levels)
        bucket = {v: self.levels[min(k - 1, bisect.bisect_left(ordered, v) * k // len(ordered))] for v in ordered}
        spans = {lv: [v for v in ordered if bucket[v] == lv] for lv in self.levels}
        log.info("curriculum: numeric difficulty bucketed by count, easiest first: " + ", ".join(
            f"{lv} {s[0]:g}..{s[-1]:g}" if s else f"{lv} none" for lv, s in spans.items()))
        return [bucket[d] if d is not None else None for d in difficulties]

    def _group(self, difficulties: Sequence[str | None], where: str) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {lv: [] for lv in self.levels}
        for i, d in enumerate(difficulties):
            if d is None:
                raise DataError(f"{where}row {i + 1} has no 'difficulty' while other rows do; give every "
                                f"row one of {', '.join(self.levels)}, or none to turn the "
                                "curriculum off")
            if d not in groups:
                raise DataError(f"{where}row {i + 1}: unknown difficulty {d!r} "
                                f"(allowed: {', '.join(self.levels)}; set curriculum.levels to your data's "
                                "levels, easiest first)")
            groups[d].append(i)
        return groups

    def _effective_mix(self, i: int, mix: tuple[float, ...]) -> dict[str, float]:
        want = dict(zip(self.levels, mix))
        missing = [lv for lv, m in want.items() if m > 0 and not self.level_counts[lv]]
        if not missing:
            return want
        avail = {lv: m for lv, m in want.items() if self.level_counts[lv]}
        total = sum(avail.values())
        if total > 0:
            eff = {lv: m / total for lv, m in avail.items()}
        else:  # every level the phase asks for is empty: spread over the ones with rows
            eff = {lv: 1 / len(avail) for lv in avail}
        eff = {lv: eff.get(lv, 0.0) for lv in self.levels}
        note = (f"curriculum phase {i + 1}: no rows for {', '.join(missing)}; mix renormalised to "
                + " ".join(f"{lv}={m:.2f}" for lv, m in eff.items()))
        self.adjustments.append(note)
        log.warning(note)
        return eff

    def _phase_index(self, step: int) -> int:
        frac = step / self.total_steps
        return next((i for i, (end, _) in enumerate(self.phases) if frac < end),
                    len(self.phases) - 1)

    def phase_mix(self, step: int) -> dict[str, float]:
        """The level shares used at ``step`` (after renormalisation); {} when off."""
        return dict(self._mixes[self._phase_index(step)]) if self.curriculum else {}

    def _counts(self, mix: dict[str, float]) -> dict[str, int]:
        counts = {lv: 0 for lv in self.levels}
        active = [lv for lv in self.levels if mix[lv] > 0]
        for _ in range(self.batch_size):
            for lv in active:
                self._credit[lv] += mix[lv]
            best = max(active, key=lambda lv: self._credit[lv])  # first max wins ties
            self._credit[best] -= 1.0
            counts[best] += 1
        return counts

    def _draw(self, key: str, k: int) -> list[int]:
        out: list[int] = []
        pool = self._pools[key]
        while len(out) < k:
            if self._pos[key] >= len(pool):
                self._rng.shuffle(pool)
                self._pos[key] = 0
            row = pool[self._pos[key]]
            self._pos[key] += 1
            if self.row_filter is None or self.row_filter.accept(row, self._rng):
                out.append(row)
        return out

    def next_batch(self) -> list[int]:
        """``batch_size`` row indices for the current step; advances the step."""
        if not self.curriculum:
            batch = self._draw(_ALL, self.batch_size)
        else:
            phase = self._phase_index(self.step)
            if phase != self._phase:
                self._phase = phase
                self._credit = {lv: 0.0 for lv in self.levels}
            counts = self._counts(self._mixes[phase])
            batch = [i for lv in self.levels for i in self._draw(lv, counts[lv])]
            self._rng.shuffle(batch)
        self.step += 1
        return batch

    def describe(self) -> str:
        """One line for logs: rows per level and the phase schedule."""
        if not self.curriculum:
            return f"curriculum off: shuffled epochs over {self.n_rows} rows"
        rows = " ".join(f"{lv}={n}" for lv, n in self.level_counts.items())
        starts = [0.0] + [e for e, _ in self.phases[:-1]]
        sched = "; ".join(
            f"[{s:.0%},{e:.0%}) " + "/".join(f"{mix[lv]:.2f}" for lv in self.levels)
            for s, (e, _), mix in zip(starts, self.phases, self._mixes))
        return (f"curriculum on: rows {rows}; {len(self.phases)} phases over {self.total_steps} "
                f"steps, mix {'/'.join(self.levels)}: {sched}")

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: step, RNG, pools and positions, credits."""
        version, internal, gauss = self._rng.getstate()
        return {"step": self.step, "phase": self._phase, "n_rows": self.n_rows,
                "curriculum": self.curriculum, "levels": list(self.levels),
                "rng": [version, list(internal), gauss],
                "pools": {k: list(v) for k, v in self._pools.items()},
                "pos": dict(self._pos), "credit": dict(self._credit),
                **({"row_filter": self.row_filter.state_dict()} if self.row_filter is not None else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state_dict; the batches continue as if never interrupted."""
        if state.get("n_rows") != self.n_rows or state.get("curriculum") != self.curriculum \
                or list(state.get("levels", [])) != list(self.levels):
            raise ValueError(
                f"sampler state does not match this dataset (state: {state.get('n_rows')} rows, "
                f"curriculum {state.get('curriculum')}, levels {state.get('levels')}; here: "
                f"{self.n_rows} rows, curriculum {self.curriculum}, levels {list(self.levels)})")
        if set(state["pools"]) != set(self._pools) or any(
                sorted(state["pools"][k]) != sorted(v) for k, v in self._pools.items()):
            raise ValueError("sampler state does not match this dataset (rows per level differ)")
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
        self._pools = {k: list(v) for k, v in state["pools"].items()}
        self._pos = {k: int(v) for k, v in state["pos"].items()}
        self._credit = {k: float(v) for k, v in state["credit"].items()}
        self._phase, self.step = int(state["phase"]), int(state["step"])
        if self.row_filter is not None and "row_filter" in state:
            self.row_filter.load_state_dict(state["row_filter"])

