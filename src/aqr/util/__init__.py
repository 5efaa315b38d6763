"""Helpers with one job each, shared across aqr: file hashing, plotting, compiling."""
