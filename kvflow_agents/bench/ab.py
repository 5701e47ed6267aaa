"""Developer tool, kept for the commands in RESULTS.md: two checkouts side by side in one run.

    python -m kvflow_agents.bench.ab --other-python /path/to/other/.venv/bin/python \\
        workflow --workflows 8 --rounds 2 --trials 10 --fresh-servers --json ab.json

is ``kvflow bench workflow|peer ... --other-python PY``: every column is served twice, by this
checkout and (as ``other-LABEL``) by the other one's venv, trials interleaved with the order
rotated, so a noisy neighbour slows both alike. (Columns were named ``this:P`` / ``other:P``
before.)
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--other-python", required=True, help="python of the other checkout's venv")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="workflow|peer and its kvflow bench flags")
    args = ap.parse_args(argv)
    if not args.bench or args.bench[0] not in ("workflow", "peer"):
        ap.error("give `workflow ...` or `peer ...` after the options")
    from kvflow_agents.cli.main import app

    app(["bench", args.bench[0], "--other-python", args.other_python, *args.bench[1:]])


if __name__ == "__main__":
    main(sys.argv[1:])
