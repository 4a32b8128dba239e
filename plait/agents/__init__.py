"""Agentic RL: verl 0.9.1's agent loops (loop.py, worker.py, runner.py, tokens.py) and tools (tools.py, tool_parser.py)."""
