"""PEER financial-QA example (Plan / Execute / Express / Review) for kvflow-agents.

Run it: ``python -m examples.peer_financial_qa.run --help`` from the repository root (or
``python examples/peer_financial_qa/run.py --help``). See README.md.
"""
