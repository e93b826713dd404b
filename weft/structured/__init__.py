"""Structured generation: grammars compiled once per spec, a matcher per sequence, token bitmasks."""
