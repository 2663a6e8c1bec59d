"""The LLaVA-1.5 family: ``record`` (torch-free facts), ``adapter`` (how care runs its checkpoints)."""
