"""The ``kvflow`` command line: see :mod:`kvflow_agents.cli.main`."""
