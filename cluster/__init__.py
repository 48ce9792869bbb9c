"""Serving, configuration and command-line adapters around ``engine``."""
