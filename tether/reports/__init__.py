"""What is made from finished runs: `compare` (`tether compare`, `tether report`), `claims` (claims tested with
t-tests with Holm's correction; `stats`: the tests themselves), `export` (`tether export`, a checkpoint as a Hugging
Face model directory)."""
