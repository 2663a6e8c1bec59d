"""`python -m care_cli` runs the same app as the `care` console script."""

from care_cli.app import main

if __name__ == "__main__":
    raise SystemExit(main())
