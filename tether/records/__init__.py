"""`tether.records`."""
