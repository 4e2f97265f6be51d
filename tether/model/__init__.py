"""`tether.model`."""
