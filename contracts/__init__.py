"""Contracts every part shares: manifest, parameter wire format, features, task config."""
