"""The report against the oracle on GPU-shaped costs (issue 28 point 6): for each GPU case of tests/oracle
(an H200 serving Qwen3-32B with vLLM, iterations priced from aiconfigurator's kernel tables) and each seed,
the oracle's truth table and verdict, then the report's verdict and goodput table on the full traces of
the oracle's traced run, and the report's step fit. Prints; asserts nothing. Runs the suite's GPU cases
(tests/oracle/cases.py `gpu_cases`) on more seeds than the suite does.

    .venv/bin/python -m bench.oracle_gpu [--seeds 1 2 3] [--cases gpu-chats ...] [--confidence 20]

About half a minute per case and seed on one core.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from tests.oracle.cases import gpu_cases
from tests.oracle.observe import observe
from tests.oracle.traces import write_full
from tests.report.conftest import oracle_options
from tracer.report.build import build_report

MARGIN = 0.15


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--cases", nargs="+", default=list(gpu_cases()))
    parser.add_argument("--confidence", type=int, default=0, help="bootstrap re-runs behind each verdict (0: none)")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="oracle-gpu-"))
    for name in args.cases:
        for seed in args.seeds:
            started = time.monotonic()
            seen = observe(name, seed, MARGIN)
            path = folder / f"{name}-{seed}.jsonl"
            write_full(path, seen.run, seed)
            report = build_report([path], oracle_options(seen, confidence_resamples=args.confidence))
            truth = seen.expected
            target = report.ratio or report.chunk_budget_tokens or ""
            print(f"{name} seed {seed} ({time.monotonic() - started:.0f} s)")
            print(f"  oracle: {truth.verdict} ({truth.best.name}, gain {truth.gain:+.0%})  "
                  + ", ".join(f"{k} {g:.3g}" for k, (_, g) in seen.table.items()))  # fmt: skip
            sure = f" (confidence {report.confidence:.0%})" if report.confidence is not None else ""
            print(f"  report: {report.verdict} {target}{sure}  "
                  + ", ".join(f"{o.label} {o.goodput_per_gpu:.3g}" for o in report.goodput))  # fmt: skip
            for line in report.evidence:
                if line.startswith("step fit"):
                    print(f"  {line}")
            for line in report.assumptions:
                if "decode batches" in line:
                    print(f"  {line}")


if __name__ == "__main__":
    main()
