"""megascale."""
