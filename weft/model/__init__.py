"""Model definitions and checkpoint loading. Never imports the engine."""
