"""`python -m ncfcli ...` is the same as `ncf ...`."""

from ncfcli.cli import main

main()
