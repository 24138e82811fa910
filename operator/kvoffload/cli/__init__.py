"""The `kvoffload` command line (top layer): one module per sub-command, `main` dispatches."""
