"""What is made from finished runs: `compare` (`tether compare`, `tether report`), `claims` (claims tested with
bootstrap intervals), `export` (`tether export`, a checkpoint as a Hugging Face model directory)."""
