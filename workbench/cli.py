"""`workbench` command line: `workbench demo`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workbench", description="Replicator Workbench")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small model on digits over mirrored virtual CPUs")
    demo.add_argument("--replicas", type=int, default=4)
    demo.add_argument("--steps", type=int, default=600)
    demo.add_argument("--out", default="workbench-demo.png", help="where to write the plot PNG")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from workbench._src.demo import demo as run_demo

        run_demo(replicas=args.replicas, steps=args.steps, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
