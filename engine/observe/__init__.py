"""What a run reports: metrics and their writers, experiment trackers, performance (FLOPs, MFU,
step time) and runs ranked by a metric."""
