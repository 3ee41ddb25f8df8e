"""`specmesh distill`: on-policy distillation of the target into the draft (DistillSpec / GKD style),
with the greedy acceptance measured before and after on held-out prompts at the k the server would draft."""
