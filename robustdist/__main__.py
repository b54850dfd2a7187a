"""``python -m robustdist``: the command-line interface (see ``robustdist.cli``)."""

from robustdist.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
