"""Correct solutions built differently from ours: the graders must accept them too."""
