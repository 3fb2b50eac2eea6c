"""Plans: a run compiled for a TPU pod with the TPU compiler on this host, its memory, collectives
and step time checked before a chip is rented; ranked layouts; a run's dry run; reading HLO."""
