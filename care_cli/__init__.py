"""Command-line interface of care (Typer + rich); all maths lives in care_core."""
