"""python -m kvckpt: the command line."""

from .cli import main

main()
