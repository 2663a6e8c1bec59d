"""The Qwen2.5-VL family: ``record`` (torch-free facts), ``adapter`` (how care runs its checkpoints)."""
