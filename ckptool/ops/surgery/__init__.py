"""key surgery: rename, filter, average, and the rules they read."""
