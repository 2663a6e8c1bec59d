"""The InternVL3 family: ``record`` (torch-free facts), ``adapter`` (how care runs its checkpoints)."""
