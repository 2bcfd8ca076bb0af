"""`python -m server …`: the same as `python -m model serve …`."""

from server.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
