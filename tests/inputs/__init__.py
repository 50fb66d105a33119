"""Hostile conditions and bad inputs: disk full, a busy journal, damaged files, odd data."""
