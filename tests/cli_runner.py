"""`python tests/cli_runner.py ARGS...` runs `tether ARGS...` in a fresh process with the test
rewards of conftest.py registered (the kill/resume tests need a process they can SIGKILL)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import conftest  # noqa: E402,F401  (registers the test rewards)
from tether.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
