"""Command-line tools (``python -m opfuse ...``) and the process launcher."""
