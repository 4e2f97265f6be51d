"""`tether.config`."""
