"""The tools a user runs: results tables, plots, the many-runs launcher, the evaluation command and the
custom-algorithm template's rules. The algorithm scripts import none of them except the template its rules."""
