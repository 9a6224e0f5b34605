"""The ``remat-dist`` / ``python -m remat_dist`` command line."""

from __future__ import annotations

import sys

USAGE = """usage: python -m remat_dist {bench,report} [options]

  bench    memory and time of remat_dist vs torch.utils.checkpoint and no
           checkpointing, in one run (prints a table; --json PATH writes it);
           bench --compile: the same for blocks compiled with torch.compile
           bench --transformers: transformers models per architecture family (no
           AC, transformers' own checkpointing, remat full / attention kept /
           MemoryBudget, torch.compile's activation_memory_budget)
  report   run the reference model and print the cross-rank saved-tensor report
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "bench" and "--transformers" in rest:
        from remat_dist.cli.bench_transformers import main as transformers_main

        return transformers_main([a for a in rest if a != "--transformers"])
    if command == "bench" and "--compile" in rest:
        from remat_dist.cli.bench_compile import main as compile_main

        return compile_main([a for a in rest if a != "--compile"])
    if command == "bench":
        from remat_dist.cli.bench import main as bench_main

        return bench_main(rest)
    if command == "report":
        from remat_dist.cli.report import main as report_main

        return report_main(rest)
    print(f"remat_dist: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
