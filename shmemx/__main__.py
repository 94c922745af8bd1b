"""``python -m shmemx`` is the ``shmemx`` command."""

from shmemx.launcher.cli import main

if __name__ == "__main__":
    main(prog_name="shmemx")
