"""Wrong solutions: real learner mistakes the graders must reject (tests/test_exercises.py)."""
