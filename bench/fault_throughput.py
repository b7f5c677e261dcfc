"""Serving throughput with the sidecar killed, against a healthy twin: the 95% target of the outage tests.

The tests in tests/faults assert that a dead telemetry backend never stalls serving (a bound a shared
2-core machine can judge); this bench measures how close to no cost at all it comes. Two like servers
(colocated, one worker, tiny preset) each ship their spans to their own `splitscope sidecar`; one sidecar
is SIGKILLed and the same closed-loop workload runs on both in alternating slices (ABBA), then the roles
swap. The figure is the geometric mean of the two phases' faulted/healthy ratios (it cancels any
difference between the servers), each phase's slices summarised by their midmean, as in the tests. An
A/A round first (both sidecars alive) shows this run's noise floor beside the figure.

    .venv/bin/python bench/fault_throughput.py               # the figure recorded in bench/RESULTS.md
    .venv/bin/python bench/fault_throughput.py --slices 24 --slice-s 1.0
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.faults.fault_harness import (  # noqa: E402
    TARGET_THROUGHPUT_RATIO,
    SidecarProcess,
    closed_loop,
    combined_ratio,
    interleaved,
    start_server,
)
from tests.reference_server.server_harness import Server  # noqa: E402


def deployment(tmp_dir: Path) -> tuple[SidecarProcess, Server]:
    """A sidecar on a Unix socket and a server shipping its spans to it."""
    tmp_dir.mkdir()
    socket_path = tmp_dir / "sidecar.sock"
    sidecar = SidecarProcess(
        tmp_dir / "sidecar.log",
        "--socket",
        str(socket_path),
        "--no-http",
        "--no-grpc",
        "--traces-file",
        str(tmp_dir / "traces.jsonl"),
    ).start()
    server = start_server(
        tmp_dir / "server", {}, "--mode", "colocated", "--workers", "1", "--sidecar-socket", str(socket_path)
    )
    return sidecar, server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slices", type=int, default=24, help="slices per server per phase")
    parser.add_argument("--slice-s", type=float, default=1.0, help="seconds of closed-loop load per slice")
    args = parser.parse_args()
    slices = {"slices": args.slices, "slice_s": args.slice_s}
    with tempfile.TemporaryDirectory() as tmp:
        with ThreadPoolExecutor(2) as pool:
            started = [pool.submit(deployment, Path(tmp) / name) for name in ("a", "b")]
        (sidecar_a, a), (sidecar_b, b) = (s.result() for s in started)
        try:
            for server in (a, b):
                closed_loop(server, 1.0, "warm-up")
            noise = combined_ratio(interleaved(a, b, **slices), interleaved(b, a, **slices))
            sidecar_b.kill()
            first = interleaved(a, b, **slices)
            sidecar_b.start()
            sidecar_a.kill()
            second = interleaved(b, a, **slices)
            ratio = combined_ratio(first, second)
        finally:
            for sidecar, server in ((sidecar_a, a), (sidecar_b, b)):
                server.close()
                sidecar.close()
    print(f"{args.slices} slices of {args.slice_s:g} s per server per phase")
    print(f"A/A (both sidecars alive): {noise:.1%}  (1.0 is no difference: this run's noise)")
    print(
        f"sidecar killed:            {ratio:.1%} of the healthy twin's throughput (target {TARGET_THROUGHPUT_RATIO:.0%})"
    )
    print(f"  b's sidecar dead: {first.describe()}")
    print(f"  a's sidecar dead: {second.describe()}")
    print(f"errors: {first.errors + second.errors}")


if __name__ == "__main__":
    main()
