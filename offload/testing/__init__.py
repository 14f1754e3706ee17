"""What users test against: the provider simulator (`offload.testing.sim`). Nothing here is imported by the
product; the package imports nothing itself, so `offload.testing.sim.config` loads alone."""
