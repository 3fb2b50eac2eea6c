"""The process a run lives in: multi-host initialisation, the local launcher, preemption, a
restarted job's recovery records, the watchdog, process settings and the run directory on disk."""
