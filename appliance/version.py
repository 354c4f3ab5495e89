"""The appliance's version, at the bottom of the import graph (the server metadata
and the CLI report it)."""

__version__ = "0.1.0"
