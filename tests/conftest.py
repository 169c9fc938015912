"""Test-wide settings: hypothesis runs derandomised (the same examples on every machine) and
keeps no example database, so CI on a clean clone is reproducible."""

from hypothesis import settings

settings.register_profile("oar", derandomize=True, database=None, deadline=None)
settings.load_profile("oar")
