"""`tether.trainer`."""
