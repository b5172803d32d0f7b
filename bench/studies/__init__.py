"""Studies: one question each, candidates side by side on one shared runner (common.py)."""
