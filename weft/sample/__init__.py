"""Batched sampling."""
