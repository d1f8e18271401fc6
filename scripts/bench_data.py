"""What a large data file costs the driver before the first step: wall time and peak memory of
reading and checking its rows (`load_rows`, what both stages call) and of SFT's whole preparation
(`load_sft_data`: read, check, render the template, tokenise), per container, each in a fresh
process so that one's memory does not count for the next.

    python scripts/bench_data.py --rows 1000000 [--containers jsonl,parquet] [--stages load,sft]

Rows are alpaca rows of about 1 KB (--row-bytes), written once under --work (default
/tmp/rlkit-bench-data). Peak memory is the process's maximum resident set (VmHWM, reset after the imports), minus the
same process's after its imports (printed as `imports`), and what it still holds when done.
One run per cell: the cost is proportional to
the rows, and a second repeat at 100k rows differed by under 5%.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _write(work: str, rows: int, row_bytes: int) -> dict[str, str]:
    """The same rows as JSONL, parquet, CSV and Arrow (written once per size)."""
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    base = os.path.join(work, f"random-{rows}-{row_bytes}")
    paths = {k: f"{base}.{k}" for k in ("jsonl", "parquet", "csv", "arrow")}
    if all(os.path.exists(p) for p in paths.values()):
        return paths
    os.makedirs(work, exist_ok=True)
    import random

    words = ["the", "model", "reads", "a", "row", "and", "learns", "what", "answer", "is", "学习", "推理", "拓扑",
             "sum", "of", "numbers", "graph", "node", "edge", "explain", "why", "step", "first", "then", "so"]
    third = row_bytes // 3

    def text(rng: random.Random, n: int) -> str:
        out: list[str] = []
        while sum(map(len, out)) + len(out) < n:
            out.append(rng.choice(words) + (str(rng.randrange(1000)) if rng.random() < 0.2 else ""))
        return " ".join(out)
    chunk = 100_000
    writers = {}
    with open(paths["jsonl"], "w", encoding="utf-8") as f:
        for start in range(0, rows, chunk):
            rng = random.Random(start)
            part = [{"instruction": text(rng, third // 2), "input": text(rng, third), "output": text(rng, third * 2),
                     "difficulty": ("explain", "reasoning", "topology")[i % 3]}
                    for i in range(start, min(rows, start + chunk))]
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in part)
            table = pa.Table.from_pylist(part)
            if not writers:
                writers = {"parquet": pq.ParquetWriter(paths["parquet"], table.schema),
                           "csv": pcsv.CSVWriter(paths["csv"], table.schema),
                           "arrow": pa.ipc.new_file(paths["arrow"], table.schema)}
            for name, w in writers.items():
                w.write_table(table) if name != "arrow" else w.write(table)
    for w in writers.values():
        w.close()
    return paths


def _rss(field: str) -> float:
    """VmRSS (now) or VmHWM (the peak since the last reset) of this process, in GiB."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    return kib / 2**20


def _child(path: str, stage: str) -> None:
    """In a fresh process: the stage's cost on one file, as one JSON line."""
    from rlkit.data.formats import load_rows

    if stage == "sft":
        from rlkit.sft.config import SFTDataConfig
        from rlkit.sft.run import load_sft_data
        from rlkit.tiny import build_tokenizer

        tokenizer = build_tokenizer(4096)  # byte-level BPE built offline
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak starts again from here
    base = _rss("VmRSS")
    if stage == "sft":
        t0 = time.perf_counter()
        got = load_sft_data(SFTDataConfig(train=path, template="alpaca", cutoff_len=512), tokenizer)
        n = len(got.train)
    else:
        t0 = time.perf_counter()
        got = load_rows(path)
        n = len(got)
    seconds = time.perf_counter() - t0
    print(json.dumps({"rows": n, "seconds": seconds, "peak_gib": _rss("VmHWM") - base,
                      "held_gib": _rss("VmRSS") - base, "base_gib": base}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--row-bytes", type=int, default=1000)
    p.add_argument("--containers", default="jsonl,parquet,csv,arrow")
    p.add_argument("--stages", default="load,sft")
    p.add_argument("--work", default="/tmp/rlkit-bench-data")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return _child(*args.child)
    paths = _write(args.work, args.rows, args.row_bytes)
    print(f"{args.rows} rows; file sizes: " + ", ".join(f"{k} {os.path.getsize(v) / 2**30:.2f} GiB"
                                                         for k, v in paths.items()))
    print("| stage | container | seconds | peak memory over imports (GiB) | held after (GiB) |\n|---|---|---|---|---|")
    for stage in args.stages.split(","):
        for kind in args.containers.split(","):
            out = subprocess.run([sys.executable, __file__, "--child", paths[kind], stage], capture_output=True,
                                 text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
            if out.returncode:
                print(f"| {stage} | {kind} | failed: {out.stderr.strip().splitlines()[-1]} | |")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"| {stage} | {kind} | {r['seconds']:.1f} | {r['peak_gib']:.2f} (imports {r['base_gib']:.2f}) | "
                  f"{r['held_gib']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
