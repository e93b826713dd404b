"""The OpenAI-compatible HTTP server (`weft serve`)."""
