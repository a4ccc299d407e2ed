"""Reference solutions, written to be read: `make grade-NN FILE=exercises/solutions/<file>`."""
