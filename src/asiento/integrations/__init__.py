"""asiento's guarantees for agents written with a framework (Pydantic AI, OpenAI Agents SDK)."""
