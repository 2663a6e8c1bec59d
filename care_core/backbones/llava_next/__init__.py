"""The LLaVA-NeXT family: ``record`` (torch-free facts), ``adapter`` (how care runs its checkpoints)."""
