"""`python -m ncfcli ...` is the same as `ncf ...`."""

from ncfcli.entry import main

main()
