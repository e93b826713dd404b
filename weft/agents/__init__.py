"""What agents need on top of plain generation: tool calls the model chooses to make (in its
family's own format, constrained so that every call it starts parses and validates), reasoning
kept apart from the answer, and the readers that turn a reply's text (whole or streamed) into
OpenAI's message shape."""
