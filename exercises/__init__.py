"""The workshop's exercises: learner files, solutions, wrong solutions and their graders."""
