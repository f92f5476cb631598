"""The Hydra application: job launching, per-job results, and the multirun summary table."""
