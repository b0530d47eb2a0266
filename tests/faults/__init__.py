"""Fault-injection suite (see README.md here)."""
