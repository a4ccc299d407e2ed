"""Wrong solutions: real learner mistakes that the graders must reject (tests/test_exercises*.py)."""
