"""``python -m ckptool``: the same as the ``ckptool`` command."""

from ckptool.cli import main

if __name__ == "__main__":
    main()
