"""A run directory, written and read: `sinks` (metrics.jsonl, TensorBoard, wandb, progress), `runlog` (the one
reader of a run's records), `summary` (summary.md, samples.jsonl), `plots`, `checkpoint`."""
