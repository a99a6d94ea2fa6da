"""Runners: ``bounded`` (a finite sync, page by page) and ``continuous`` (epochs, one commit order)."""
