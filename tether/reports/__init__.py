"""`tether.reports`."""
