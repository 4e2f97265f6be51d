"""`tether train`: `loop` (the loop), `setup` (a run built or resumed), `step` (one RL step), `sampling` (on-policy,
stale or overlapped, behind one interface; `staleness`, `overlap`), `data` (the prompt stream), `warmstart` and
`sft`, `stopping` (signals), `limits` (lengths checked against the model)."""
