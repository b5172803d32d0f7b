"""The comparison suite (python -m bench.suite); see bench/suite.py."""
