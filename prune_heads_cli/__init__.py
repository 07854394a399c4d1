"""The prune-heads command line: the command table (main.py) and what each command does (commands.py).

This package sits above both the core (``prune_heads``) and the exporters (``exporters``) and is the only code that
imports both."""
