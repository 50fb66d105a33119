"""Real providers over HTTP: gateways, the idempotency proxy, crashes in the paid window."""
