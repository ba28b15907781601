"""`kiln` subcommands, one module each (add_arguments + run); those on a model are in
``models/``."""
