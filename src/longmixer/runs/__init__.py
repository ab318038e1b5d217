"""Run directories: resume selection, locks, config-drift checks, run info, loggers, results."""
