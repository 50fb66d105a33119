"""Crash tests: real child processes killed with SIGKILL, checked against external ledgers."""
