"""``python -m pocketfm`` = the ``pocketfm`` command."""
from .cli import main

main()
