"""Scheduling plugins, one per file: filters, scorers and pickers."""
