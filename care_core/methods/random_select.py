"""Placeholder: filled in by the method's implementation."""
