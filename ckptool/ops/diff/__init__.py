"""diff and report: two checkpoints compared, and the self-contained HTML page."""
