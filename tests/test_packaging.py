"""The wheel (a normal, non-editable install) holds the mapped sub-packages and data files,
and imports from a folder that is not the source tree."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_build_and_plain_install(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(ROOT)],
                   check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = dist.glob("kvflow_agents-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for must in ("kvflow_agents/__init__.py", "kvflow_agents/graph/step_graph.py",
                 "kvflow_agents/adapters/__init__.py", "kvflow_agents/serving/policy/backend.py",
                 "kvflow_agents/schemas/hints_v1.schema.json", "kvflow_agents/cli/main.py"):
        assert must in names, must
    assert not any(n.startswith(("graph/", "serving/", "adapters/", "tests/")) for n in names)

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                    "--target", str(target), str(wheel)], check=True, capture_output=True)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import kvflow_agents as k, kvflow_agents.graph as g; "
            "assert k.__file__.startswith(sys.argv[1]), k.__file__; "
            "from kvflow_agents.protocol import SCHEMA_PATH; assert SCHEMA_PATH.exists(); "
            "print(g.AgentStepGraph('x').add_edge('a','b').steps_to_execution({'a'}))")
    out = subprocess.run([sys.executable, "-c", code, str(target)], check=True, capture_output=True,
                         text=True, cwd=tmp_path)
    assert "'b': 1" in out.stdout


def test_cli_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "kvflow_agents.cli.main", "--help"], check=True,
                         capture_output=True, text=True)
    assert "bench" in out.stdout and "graph" in out.stdout


def test_cli_rejects_bad_flags_clearly():
    out = subprocess.run([sys.executable, "-m", "kvflow_agents.cli.main", "graph", "demo", "--format", "xml"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "--format" in (out.stderr + out.stdout)
