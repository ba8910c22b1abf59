"""Reporting: engines' step-tagged counts, sent to Redis."""
