"""The ``remat-dist`` / ``python -m remat_dist`` command line: what a user runs on
their own job. remat_dist's own benchmarks are not part of the package: they live
beside it, in the repository's ``benchmarks/`` directory."""

from __future__ import annotations

import sys

USAGE = """usage: python -m remat_dist report [options]

  report   run the reference model and print the cross-rank saved-tensor report
"""

BENCHMARKS_MOVED = """remat_dist: the benchmarks are not part of the installed package any more.
They live in the repository's benchmarks/ directory; from the root of a checkout:

  python -m benchmarks.core --json bench.json      (was: python -m remat_dist bench)
  python -m benchmarks.compiled                    (was: bench --compile)
  python -m benchmarks.hf_transformers             (was: bench --transformers)
  python -m benchmarks.budget                      (was: bench --budget)
  python -m benchmarks.scale                       (was: bench --scale)
  python -m benchmarks.exits                       (was: bench --exits)

docs/benchmarks.md lists them all and what they measured.
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "report":
        from remat_dist.cli.report import main as report_main

        return report_main(rest)
    if command == "bench":
        print(BENCHMARKS_MOVED, file=sys.stderr)
        return 2
    print(f"remat_dist: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
