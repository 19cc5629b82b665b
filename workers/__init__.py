"""Tier worker processes and their storage engines."""
