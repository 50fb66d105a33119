"""``python -m asiento`` is the ``asiento`` command."""

from .cli import main

main()
