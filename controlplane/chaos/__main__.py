"""`python -m controlplane.chaos --minutes N`: one soak, its report, exit 1 on any violation."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from controlplane.chaos.plan import FAULT_KINDS
from controlplane.chaos.soak import Options, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dev.py chaos", description=__doc__)
    parser.add_argument("--minutes", type=float, default=2.0, help="how long faults are injected")
    parser.add_argument("--seed", type=int, default=1, help="the schedule's and the workload's seed")
    parser.add_argument("--apis", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--reconcilers", type=int, default=2)
    parser.add_argument("--max-instances", type=int, default=6, help="live instances at most")
    parser.add_argument("--min-interval", type=float, default=5.0, help="shortest gap between faults (s)")
    parser.add_argument("--max-interval", type=float, default=40.0, help="longest gap between faults (s)")
    parser.add_argument(
        "--faults",
        default=",".join(FAULT_KINDS),
        help=f"the kinds of fault to inject, comma-separated (default: all of {', '.join(FAULT_KINDS)})",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("chaos-report"), help="the report: <out>.md and <out>.json"
    )
    parser.add_argument(
        "--root", type=Path, help="keep the soak's processes' files here (default: a scratch dir)"
    )
    args = parser.parse_args(argv)
    if args.minutes <= 0 or not 0 < args.min_interval <= args.max_interval:
        parser.error("--minutes must be positive and 0 < --min-interval <= --max-interval")
    kinds = tuple(k.strip() for k in args.faults.split(",") if k.strip())
    if not kinds or set(kinds) - set(FAULT_KINDS):
        parser.error(f"--faults takes kinds among {', '.join(FAULT_KINDS)}")
    # SIGTERM (timeout, a plain kill) stops the soak like Ctrl-C: its processes are stopped too.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    report = run(
        Options(
            minutes=args.minutes,
            seed=args.seed,
            apis=args.apis,
            workers=args.workers,
            reconcilers=args.reconcilers,
            max_instances=args.max_instances,
            min_interval_s=args.min_interval,
            kinds=kinds,
            max_interval_s=args.max_interval,
            out=args.out,
            root=args.root,
        )
    )
    print(report.markdown())
    print(f"report: {args.out.with_suffix('.md')}, {args.out.with_suffix('.json')}")
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
