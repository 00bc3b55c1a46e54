"""Checking a result: seeded inputs, the torch reference, and the accuracy verdict."""
