"""The graders: `python -m exercises.grader NN [FILE]` (or `make grade-NN [FILE=...]`)."""
