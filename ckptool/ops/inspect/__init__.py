"""inspect: what a checkpoint holds, without reading tensor data."""
