"""Developer tool: two checkouts of kvflow-agents side by side in ONE ``kvflow bench`` run.

    python -m kvflow_agents.bench.ab --other-python /work/main/.venv/bin/python \\
        workflow --agents 10 --fixed 1024 --dynamic 32 --output 16 --rounds 3 --trials 3 \\
        --host-link-gbps 0.1 --json ab.json

Every policy runs twice, as ``other:<policy>`` (``kvflow serve`` of the interpreter given, i.e.
the other checkout's code) and ``this:<policy>`` (this interpreter's). The harness is the usual
one (``kvflow bench workflow`` / ``peer``): all servers side by side, trials interleaved with the
order rotated, so a noisy neighbour on the machine slows both checkouts alike. Pass
``--host-link-gbps`` (the link calibration keys on plain policy names). Ratios between the
two columns of a policy are the comparison; the targets table does not apply to these labels.
"""

from __future__ import annotations

import argparse
import os
import sys

SIDES = ("other", "this")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--other-python", required=True, help="python of the other checkout's venv")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="workflow|peer and its kvflow bench flags")
    args = ap.parse_args(argv)
    if not args.bench or args.bench[0] not in ("workflow", "peer"):
        ap.error("give `workflow ...` or `peer ...` after the options")
    os.chdir("/")  # `python -m` puts the cwd first on sys.path: no checkout may shadow either side

    from kvflow_agents.bench import peer, runner
    from kvflow_agents.serve_process import ServeProcess

    plain_args = runner.ServerConfig.args

    def parse(text: str) -> list[str]:
        pols = [p for p in (text or ",".join(runner.POLICIES)).split(",") if p]
        bad = [p for p in pols if p not in runner.POLICIES]
        if bad:
            raise ValueError(f"unknown policy {', '.join(bad)}")
        return [f"{side}:{p}" for p in pols for side in SIDES]

    class ABServerSet(runner.ServerSet):
        def __enter__(self):
            try:
                for label in self.policies:
                    cmd = ([args.other_python, "-m", "kvflow_agents.cli.main", "serve"]
                           if label.startswith("other:") else None)
                    self.log(f"[{label}] starting: {' '.join(self.config.args(label))}")
                    self.servers[label] = ServeProcess(
                        self.config.args(label), command=cmd, env={"PYTHONDONTWRITEBYTECODE": "1"},
                        timeout_s=self.config.startup_timeout_s).start()
            except BaseException:
                self.__exit__()
                raise
            return self

    runner.parse_policies = parse
    runner.ServerConfig.args = lambda self, label: plain_args(self, label.split(":", 1)[-1])
    runner.ServerSet = peer.ServerSet = ABServerSet

    from kvflow_agents.cli.main import app

    app(["bench", *args.bench])


if __name__ == "__main__":
    main(sys.argv[1:])
