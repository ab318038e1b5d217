"""Seeded, faithful generators for the synthetic LRA tasks."""
