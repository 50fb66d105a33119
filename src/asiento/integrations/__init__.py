"""Agents written with other frameworks (Pydantic AI, OpenAI Agents SDK) on asiento's journal:
one module per framework, each an optional extra."""
