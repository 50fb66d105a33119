"""Agents written with other frameworks, on asiento's journal: one module per framework."""
