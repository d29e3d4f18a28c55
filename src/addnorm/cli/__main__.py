"""``python -m addnorm.cli``: the ``addnorm`` command line."""

from .commands import main

if __name__ == "__main__":
    main()
