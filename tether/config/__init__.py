"""The training configuration: `sections` (the config as plain values), `loading` (YAML, overrides, the checks
that ask the rest of tether, resume), `help` (`tether train --help-config`)."""
