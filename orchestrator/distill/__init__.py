"""`specmesh distill`: on-policy distillation of the target into the draft (DistillSpec / GKD style),
with the greedy acceptance at fixed k measured before and after on held-out prompts."""
