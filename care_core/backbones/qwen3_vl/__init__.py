"""The Qwen3-VL family: ``record`` (torch-free facts), ``adapter`` (how care runs its checkpoints)."""
