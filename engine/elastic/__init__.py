"""Elastic training: one supervisor loop over a membership (local processes, SLURM steps), the
pods' supervisors meeting through a rendezvous, and the accounting all of them share."""
