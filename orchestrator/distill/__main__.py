"""`python -m orchestrator.distill FLAGS`: `specmesh distill FLAGS`, reading its flags first.

`specmesh` itself imports torch, transformers and every other command's options before it parses a
flag. The online distillation child (orchestrator.distill.online_cycle) starts here: it runs at
nice 19, and on a busy node a bad flag took minutes to be reported instead of failing at once.
"""

from __future__ import annotations

import argparse
import sys

from orchestrator.distill import args as distill_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specmesh")
    distill_args.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["distill", *(sys.argv[1:] if argv is None else argv)])
    from orchestrator.distill.app import run  # torch, peft and matplotlib: once the flags are good
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
