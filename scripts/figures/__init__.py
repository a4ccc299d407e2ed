"""Each chapter's figures, drawn from its results.json alone (no rank is launched)."""
